"""GGUF files by hub name with a quant tag ("org/name:Q4_K_M", "org/name:NAME.gguf",
--hf-file), from a hub cache laid out as huggingface_hub lays it out, offline
(HF_HUB_OFFLINE=1 holds for every test: nothing is downloaded); split files included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.models.loader import load_model, resolve_checkpoint
from tests.models.test_llama import PROMPT, tiny_config
from tests.models.utils import bind_kv_caches, prompt_logprobs, save_tiny_gguf, save_tiny_model

REPO = "tiny-org/tiny-GGUF"
COMMIT = "c" * 40


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(cache, snapshot): tiny-Q4_K_M.gguf, tiny-Q8_0.gguf, tiny.mmproj-Q8_0.gguf and a
    Q6_K model split in three files under Q6_K/."""
    from transformers import AutoTokenizer

    hf_dir = tmp_path_factory.mktemp("tiny-hf")
    hf = save_tiny_model(hf_dir, tiny_config("llama"))
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    cache = tmp_path_factory.mktemp("hub")
    folder = cache / f"models--{REPO.replace('/', '--')}"
    snapshot = folder / "snapshots" / COMMIT
    (snapshot / "Q6_K").mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(COMMIT)
    save_tiny_gguf(snapshot / "tiny-Q4_K_M.gguf", hf, tokenizer, "Q4_1")
    save_tiny_gguf(snapshot / "tiny-Q8_0.gguf", hf, tokenizer, "Q8_0")
    save_tiny_gguf(snapshot / "tiny.mmproj-Q8_0.gguf", hf, tokenizer, "Q8_0")
    save_tiny_gguf(snapshot / "Q6_K" / "tiny-Q6_K.gguf", hf, tokenizer, "Q8_0", split_max_tensors=12)
    return cache, snapshot


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))


def test_quant_tag_and_file_name(hub: tuple[Path, Path]) -> None:
    cache, snapshot = hub
    assert resolve_checkpoint(f"{REPO}:Q4_K_M", download_dir=str(cache)) == (str(snapshot / "tiny-Q4_K_M.gguf"), None)
    # Case-insensitive; the projector file (mmproj) is not a model.
    assert resolve_checkpoint(f"{REPO}:q8_0", download_dir=str(cache))[0] == str(snapshot / "tiny-Q8_0.gguf")
    assert resolve_checkpoint(f"{REPO}:tiny.mmproj-Q8_0.gguf", download_dir=str(cache))[0].endswith("mmproj-Q8_0.gguf")
    # --hf-file: folded into the same form by the configuration.
    model = EngineArgs(model=REPO, hf_file="tiny-Q8_0.gguf").create_engine_config().load_config.model
    assert model == f"{REPO}:tiny-Q8_0.gguf"
    assert resolve_checkpoint(model, download_dir=str(cache))[0] == str(snapshot / "tiny-Q8_0.gguf")
    with pytest.raises(ValueError, match="must name a .gguf file"):
        EngineArgs(model=f"{REPO}:Q8_0", hf_file="x.gguf").create_engine_config()


def test_no_match_names_the_files(hub: tuple[Path, Path]) -> None:
    cache, _ = hub
    with pytest.raises(ValueError, match=r"has none matching 'Q5_K_M' \(its GGUF files in .*: Q6_K/tiny-Q6_K-00001-of-0000\d\.gguf"):
        resolve_checkpoint(f"{REPO}:Q5_K_M", download_dir=str(cache))
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE=1: from the cache alone"):
        resolve_checkpoint("tiny-org/absent-GGUF:Q4_K_M", download_dir=str(cache))


def test_split_file_loads_every_split(hub: tuple[Path, Path]) -> None:
    cache, snapshot = hub
    splits = sorted((snapshot / "Q6_K").iterdir())
    assert len(splits) >= 2 and splits[0].name.endswith("-00001-of-" + splits[0].name[-10:])
    path, _ = resolve_checkpoint(f"{REPO}:Q6_K", download_dir=str(cache))
    assert path == str(splits[0])
    whole: Any = load_model(str(snapshot / "tiny-Q8_0.gguf"))
    split: Any = load_model(f"{REPO}:Q6_K", download_dir=str(cache))
    assert split.gguf_path == str(splits[0])
    out = {}
    for name, loaded in (("whole", whole), ("split", split)):
        bind_kv_caches(loaded.model, num_blocks=8, block_size=16)
        out[name] = prompt_logprobs(loaded.model, PROMPT)
    torch.testing.assert_close(out["split"], out["whole"], atol=0, rtol=0)
    # A missing split is named.
    splits[-1].rename(splits[-1].with_suffix(".bak"))
    try:
        with pytest.raises(ValueError, match="is split in .* files; missing: .*" + splits[-1].name):
            load_model(f"{REPO}:Q6_K", download_dir=str(cache))
    finally:
        splits[-1].with_suffix(".bak").rename(splits[-1])
