"""Checkpoints by hub id (models/hub.py, loader.resolve_checkpoint), offline: a hub cache laid
out as huggingface_hub lays it out (models--org--name/snapshots/<commit>/, refs/<name>) in a
temporary directory, with tiny random checkpoints. HF_HUB_OFFLINE=1 holds for every test
(tests/conftest.py): nothing here touches the network."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.cli import build_parser
from pagedllm.models.loader import PACKAGED_MODELS, resolve_checkpoint
from tests.models.test_phi3 import tiny_phi3_config
from tests.models.utils import save_random_model

REPO = "tiny-org/tiny-phi3"
MAIN = "a" * 40
V2 = "b" * 40


def _snapshot(cache: Path, repo: str, commit: str, refs: tuple[str, ...], seed: int) -> Path:
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit
    config = tiny_phi3_config()
    config.vocab_size = 262
    save_random_model(snapshot, config, seed=seed)
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (folder / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """(cache dir, {commit: snapshot dir}): main and a tagged second revision of REPO."""
    cache = tmp_path_factory.mktemp("hub-cache")
    snapshots = {MAIN: _snapshot(cache, REPO, MAIN, ("main",), seed=0), V2: _snapshot(cache, REPO, V2, ("v2",), seed=1)}
    return cache, snapshots


def test_offline_everywhere_in_the_tests() -> None:
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def test_hub_id_resolves_from_the_cache(hub_cache: tuple[Path, dict[str, Path]], monkeypatch: pytest.MonkeyPatch) -> None:
    cache, snapshots = hub_cache
    assert resolve_checkpoint(REPO, download_dir=str(cache)) == (None, str(snapshots[MAIN]))
    # A branch or tag through refs/, a commit directly.
    assert resolve_checkpoint(REPO, "v2", str(cache)) == (None, str(snapshots[V2]))
    assert resolve_checkpoint(REPO, V2, str(cache)) == (None, str(snapshots[V2]))
    # Without --download-dir: $HF_HUB_CACHE.
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert resolve_checkpoint(REPO, "v2") == (None, str(snapshots[V2]))


def test_missing_id_or_revision_is_a_clear_error(hub_cache: tuple[Path, dict[str, Path]]) -> None:
    cache, _ = hub_cache
    message = rf"no complete snapshot of revision main of 'tiny-org/absent' \(HF_HUB_OFFLINE=1: from the cache alone\)"
    with pytest.raises(ValueError, match=message) as error:
        resolve_checkpoint("tiny-org/absent", download_dir=str(cache))
    assert str(cache) in str(error.value) and "a known name (SmolLM2-135M-Instruct" in str(error.value)
    with pytest.raises(ValueError, match=r"no complete snapshot of revision v3 of 'tiny-org/tiny-phi3'"):
        resolve_checkpoint(REPO, "v3", str(cache))
    with pytest.raises(ValueError, match=r"or a Hugging Face hub id \(org/name, or org/name:QUANT for a GGUF repo\)$"):
        resolve_checkpoint("not//a hub id", download_dir=str(cache))


def test_precedence_local_path_then_packaged_name_then_hub(
    hub_cache: tuple[Path, dict[str, Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, snapshots = hub_cache
    # A directory at the relative path REPO wins over the hub cache's REPO.
    monkeypatch.chdir(tmp_path)
    shutil.copytree(snapshots[V2], tmp_path / REPO)
    assert resolve_checkpoint(REPO, download_dir=str(cache)) == (None, REPO)
    # A packaged name wins over a hub snapshot of the same id.
    packaged = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert packaged in PACKAGED_MODELS
    _snapshot(cache, packaged, MAIN, ("main",), seed=0)
    gguf_path, model_dir = resolve_checkpoint(packaged, download_dir=str(cache))
    assert model_dir is None and gguf_path is not None and gguf_path.endswith(".gguf")


def test_engine_serves_a_hub_id_at_a_revision(hub_cache: tuple[Path, dict[str, Path]]) -> None:
    # The two revisions are different random checkpoints: their greedy tokens differ.
    cache, _ = hub_cache
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens: dict[str, Any] = {}
    for revision in (None, "v2"):
        llm = LLM(REPO, revision=revision, download_dir=str(cache), dtype="float32", kv_cache_memory_bytes="8MiB")
        assert llm.llm_engine.model_config.model == REPO
        tokens[str(revision)] = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens["None"] != tokens["v2"], tokens


def test_help_states_the_precedence(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "in this order: a local path (.gguf file or HF directory), a packaged model name" in text
    assert "or a Hugging Face hub id such as Qwen/Qwen3-0.6B" in text
    assert "--revision" in text and "--download-dir" in text
