"""load_model: name resolution, errors, GGUF metadata and its cache (on a tiny GGUF)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm.models import gguf_loader
from pagedllm.models.gguf_loader import check_tensor_types
from pagedllm.models.loader import load_model, resolve_checkpoint
from pagedllm.models.registry import resolve_model_class, supported_architectures
from tests.models.test_llama import PROMPT, hf_logprobs, tiny_config
from tests.models.utils import (
    TINY_EOS_ID,
    TINY_IM_END_ID,
    bind_kv_caches,
    prompt_logprobs,
    save_tiny_gguf,
    save_tiny_model,
)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    path = tmp_path_factory.mktemp("tiny-llama")
    return save_tiny_model(path, tiny_config("llama")), path


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def write_gguf(tiny_hf: tuple[Any, Path], qtype: str) -> Path:
    from transformers import AutoTokenizer

    hf_model, hf_dir = tiny_hf
    path = hf_dir / f"tiny-{qtype}.gguf"  # beside HF tokenizer files, which must not leak in
    save_tiny_gguf(path, hf_model, AutoTokenizer.from_pretrained(hf_dir), qtype)
    return path


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "F16"])
def test_gguf_matches_hf_reading_the_same_file(
    tiny_hf: tuple[Any, Path], tmp_path: Path, cache_dir: Path, qtype: str
) -> None:
    from transformers import AutoModelForCausalLM

    path = write_gguf(tiny_hf, qtype)
    loaded = load_model(str(path))
    assert loaded.gguf_path == str(path)
    assert loaded.model_dir.startswith(str(cache_dir))
    assert loaded.model_config.architecture == "LlamaForCausalLM"
    assert loaded.model_config.eos_token_ids == (TINY_EOS_ID, TINY_IM_END_ID)
    bind_kv_caches(loaded.model, num_blocks=8, block_size=16)
    ours = prompt_logprobs(loaded.model, PROMPT)
    ref_model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    # Q8_0 is kept as blocks: the prompt's rows take the small-M kernel's int16 activations
    # (1/65534 of a group's largest |x|; measured 1.8e-4), the bound test_gguf_kept.py gives
    # every block type.
    bound = 1e-3 if qtype == "Q8_0" else 1e-4
    torch.testing.assert_close(ours, hf_logprobs(ref_model, PROMPT), atol=bound, rtol=0)


def test_gguf_tokenizer_and_chat_template(
    tiny_hf: tuple[Any, Path], tmp_path: Path, cache_dir: Path
) -> None:
    from transformers import AutoTokenizer

    original = AutoTokenizer.from_pretrained(tiny_hf[1])
    tokenizer = load_model(str(write_gguf(tiny_hf, "Q8_0"))).tokenizer
    messages = [{"role": "user", "content": "Hello there"}]
    kwargs = {"add_generation_prompt": True, "return_dict": False}
    ids = tokenizer.apply_chat_template(messages, **kwargs)
    assert ids == original.apply_chat_template(messages, **kwargs)
    assert tokenizer.encode("the theme") == original.encode("the theme")


def test_gguf_cache_is_reused(
    tiny_hf: tuple[Any, Path], tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_gguf(tiny_hf, "Q8_0")
    first = load_model(str(path))
    assert os.listdir(cache_dir) == [os.path.basename(first.model_dir)]  # no temp dir left
    # Metadata only: no weights are ever written to the cache.
    assert sorted(n for n in os.listdir(first.model_dir) if not n.endswith((".json", ".jinja"))) == []

    def no_conversion(*args: object) -> None:
        raise AssertionError("read the metadata again despite the cache")

    monkeypatch.setattr(gguf_loader, "_write_metadata", no_conversion)
    second = load_model(str(path))
    assert second.model_dir == first.model_dir
    ours, theirs = first.model.state_dict(), second.model.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    # A changed file (new mtime) gets a new cache entry.
    os.utime(path, ns=(0, 12345))
    monkeypatch.undo()
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(cache_dir))
    assert load_model(str(path)).model_dir != first.model_dir


def test_unknown_model_name() -> None:
    with pytest.raises(ValueError, match=r"not a known name \(SmolLM2-135M-Instruct.*\.gguf"):
        load_model("no-such-org/no-such-model")


def test_unknown_architecture(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, tiny_config("llama"))
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    message = "'NoSuchModelForCausalLM' is not supported; supported: .*LlamaForCausalLM"
    with pytest.raises(ValueError, match=message):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="supported: "):
        resolve_model_class("GPTNeoXForCausalLM")
    assert "LlamaForCausalLM" in supported_architectures()


def test_bad_arguments(tiny_hf: tuple[Any, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dtype='float16' is not supported"):
        load_model(str(tiny_hf[1]), dtype="float16")
    with pytest.raises(ValueError, match="max_model_len=4096 must be between 1 and .* 128"):
        load_model(str(tiny_hf[1]), max_model_len=4096)
    assert load_model(str(tiny_hf[1]), max_model_len=64).model_config.max_model_len == 64
    (tmp_path / "config.json").write_text((tiny_hf[1] / "config.json").read_text())
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        load_model(str(tmp_path))
    for name in os.listdir(tiny_hf[1]):
        if name.endswith(".safetensors"):
            (tmp_path / name).write_bytes((tiny_hf[1] / name).read_bytes())
    with pytest.raises(ValueError, match="no usable tokenizer"):
        load_model(str(tmp_path))


def test_resolve_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"")
    assert resolve_checkpoint(str(tmp_path / "m.gguf")) == (str(tmp_path / "m.gguf"), None)
    assert resolve_checkpoint(str(tmp_path)) == (str(tmp_path / "m.gguf"), None)
    (tmp_path / "config.json").write_text("{}")
    assert resolve_checkpoint(str(tmp_path)) == (None, str(tmp_path))


def test_unsupported_gguf_tensor_type() -> None:
    with pytest.raises(ValueError, match="type Q8_K; supported: F32, F16, BF16, Q4_0"):
        check_tensor_types(["Q4_1", "IQ2_XXS", "Q8_K"], "x.gguf")
    check_tensor_types(["Q4_1", "F32", "IQ2_XXS", "Q6_K", "IQ4_XS", "MXFP4"], "x.gguf")


def test_gguf_index_matches_gguf_reader(tiny_hf: tuple[Any, Path], cache_dir: Path) -> None:
    import gguf
    import numpy as np

    from pagedllm.models.gguf_index import tensor_data

    path = write_gguf(tiny_hf, "Q4_1")
    index = gguf_loader.gguf_index(str(path))
    reader = gguf.GGUFReader(str(path))
    assert index.architecture == "llama"
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    file_map = index.open_data()
    for ours, theirs in zip(index.tensors, reader.tensors):
        assert ours.type_name == theirs.tensor_type.name
        assert ours.dims == tuple(theirs.shape.tolist())
        data = tensor_data(file_map, ours)
        assert data.dtype == theirs.data.dtype and np.array_equal(data, theirs.data), ours.name
    assert index.type_names(ndim=2) == {"Q4_1", "Q8_0"}  # projections, and the embedding


def test_gguf_index_is_reused_and_dropped_when_the_file_changes(
    tiny_hf: tuple[Any, Path], cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gguf
    from transformers import AutoTokenizer

    from pagedllm.models.gguf_index import INDEX_FILE, load_index

    path = write_gguf(tiny_hf, "Q4_1")
    gguf_loader._gguf_index.cache_clear()
    first = load_model(str(path))
    assert first.quantization == "gguf"
    assert os.path.isfile(os.path.join(first.model_dir, INDEX_FILE))

    def no_parse(*args: object) -> None:
        raise AssertionError("parsed the GGUF metadata again despite the cached index")

    # A new process (no in-memory cache) loads the same weights without parsing the file.
    gguf_loader._gguf_index.cache_clear()
    monkeypatch.setattr(gguf, "GGUFReader", no_parse)
    second = load_model(str(path))
    ours, theirs = first.model.state_dict(), second.model.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name

    # The file changes in place (another quantization, same path): the old index is stale,
    # even read from the old cache entry, and a load parses the new file.
    save_tiny_gguf(path, tiny_hf[0], AutoTokenizer.from_pretrained(tiny_hf[1]), "Q8_0")
    assert load_index(first.model_dir, str(path)) is None
    with pytest.raises(ValueError, match="parsed the GGUF metadata again"):  # through the metadata step
        load_model(str(path))
    monkeypatch.undo()
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(cache_dir))
    third = load_model(str(path))
    assert third.model_dir != first.model_dir
    assert gguf_loader.gguf_quant_types(str(path)) == {"Q8_0"}
    assert load_index(third.model_dir, str(path)) is not None
    # A touched file (same bytes, new mtime) is not trusted either.
    os.utime(path, ns=(0, 12345))
    assert load_index(third.model_dir, str(path)) is None


def test_harmony_end_closes_a_message_not_the_turn(tmp_path) -> None:
    # <|end|> ends a Phi-3 turn (an EOS id); in harmony (gpt-oss: the vocabulary has
    # <|channel|>) it closes one message, and the turn ends at <|return|> or <|call|>.
    from types import SimpleNamespace

    from pagedllm.models.loader import eos_token_ids

    config = SimpleNamespace(vocab_size=16, eos_token_id=None)
    phi3 = SimpleNamespace(added_tokens_encoder={"<|end|>": 5}, eos_token_id=None)
    assert eos_token_ids(str(tmp_path), config, phi3) == (5,)
    harmony = SimpleNamespace(
        added_tokens_encoder={"<|end|>": 5, "<|return|>": 6, "<|call|>": 7, "<|channel|>": 8}, eos_token_id=None)
    assert eos_token_ids(str(tmp_path), config, harmony) == (6, 7)
