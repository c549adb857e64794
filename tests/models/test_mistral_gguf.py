"""Mistral GGUF files: llama.cpp's converter writes MistralForCausalLM as the `llama`
architecture (Q/K rows permuted, `rope.dimension_count` = head_dim, no sliding-window key), so
they load as the Llama family. Mixtral files (`llama` with `llama.expert_count` and expert
tensors) are tested in test_moe.py::test_mixtral_gguf_as_llama_with_experts.

References: HF's MistralForCausalLM on the source directory (an F32 file holds its weights
exactly) and HF transformers reading the same file (`gguf_file=`, a LlamaForCausalLM).
Bounds (float32 activations): |d logprob| <= 1e-3 (test_gguf_kept.py's), greedy equal by
DESIGN.md's tie rule.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pagedllm.models.loader import load_model
from tests.models.test_llama import hf_logprobs
from tests.models.utils import (
    TINY_BOS_ID,
    TINY_EOS_ID,
    bind_kv_caches,
    convert_with_llama_cpp,
    greedy_generate,
    llama_cpp_dir,
    prompt_logprobs,
    save_random_model,
    save_tiny_gguf,
    save_tiny_tokenizer,
)
from tests.utils import assert_greedy_match, hf_greedy

BOUND = 1e-3
NUM_STEPS = 8
# 40 tokens: past the window of the windowed case below.
PROMPT = torch.randint(0, 262, (40,), generator=torch.Generator().manual_seed(5)).tolist()


def tiny_mistral_config(sliding_window: int | None = None) -> Any:
    """GQA and a head_dim (48) that is not hidden / heads (32), as Mistral Nemo's."""
    from transformers import MistralConfig

    return MistralConfig(
        vocab_size=262, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=48, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=sliding_window,
        tie_word_embeddings=False, bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID,
    )  # fmt: skip


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))


def _write(tmp_path: Path, hf_model: Any, qtype: str) -> Path:
    """The model as llama.cpp's converter writes a MistralForCausalLM: `llama`, its config's
    sliding window not written (LlamaModel.set_gguf_parameters has no such key)."""
    path = tmp_path / "gguf" / "tiny-mistral.gguf"
    path.parent.mkdir()
    cfg = copy.deepcopy(hf_model.config)
    cfg.sliding_window = None
    as_written = SimpleNamespace(config=cfg, state_dict=hf_model.state_dict)
    save_tiny_gguf(
        path, as_written, save_tiny_tokenizer(tmp_path / "tok"), qtype=qtype, arch="llama",
        type_of=lambda name: qtype, extra=lambda writer: writer.add_rope_dimension_count(cfg.head_dim),
    )  # fmt: skip
    return path


def _hf_from_gguf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def _check(model: Any, ref: Any) -> None:
    bind_kv_caches(model, num_blocks=8, block_size=16)
    torch.testing.assert_close(prompt_logprobs(model, PROMPT), hf_logprobs(ref, PROMPT), atol=BOUND, rtol=0)
    ours = greedy_generate(model, PROMPT, NUM_STEPS).token_ids[len(PROMPT) :]
    ref_tokens, gaps = hf_greedy(ref, PROMPT, NUM_STEPS)
    assert_greedy_match(ours, ref_tokens, gaps, type(ref).__name__)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_0"])
def test_mistral_gguf_loads_as_llama_and_matches_hf(tmp_path: Path, qtype: str) -> None:
    hf_model = save_random_model(tmp_path / "src", tiny_mistral_config())
    path = _write(tmp_path, hf_model, qtype)
    loaded = load_model(str(path))
    assert loaded.model_config.architecture == "LlamaForCausalLM"
    assert loaded.model_config.head_dim == 48 and loaded.model_config.num_kv_heads == 2
    _check(loaded.model, _hf_from_gguf(path))
    if qtype == "F32":  # the file holds the source's weights exactly: HF's own Mistral agrees
        _check(loaded.model, hf_model)


def test_mistral_sliding_window_is_not_in_the_file(tmp_path: Path) -> None:
    # Mistral 7B v0.1's window (4096) does not survive llama.cpp's conversion: the file, and
    # llama.cpp and transformers reading it, attend fully. So does our load; it then differs
    # from the source directory's windowed Mistral on prompts past the window (here 6 < 40).
    hf_model = save_random_model(tmp_path / "src", tiny_mistral_config(sliding_window=6))
    path = _write(tmp_path, hf_model, "F32")
    loaded = load_model(str(path))
    assert loaded.model_config.sliding_window is None
    _check(loaded.model, _hf_from_gguf(path))
    bind_kv_caches(loaded.model, num_blocks=8, block_size=16)
    windowed = hf_logprobs(hf_model, PROMPT)
    assert float((prompt_logprobs(loaded.model, PROMPT) - windowed).abs().max()) > 0.1


@pytest.mark.slow  # the converter's own start (torch, transformers)
@pytest.mark.skipif(llama_cpp_dir() is None, reason="PAGEDLLM_LLAMA_CPP_DIR names no llama.cpp tree")
@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_mistral_written_by_llama_cpp_converter(tmp_path: Path, outtype: str) -> None:
    # The converter's own `llama` file of a windowed Mistral: what _write above assumes
    # (Q/K permuted, rope.dimension_count = head_dim, no window key).
    hf_model = save_random_model(tmp_path / "src", tiny_mistral_config(sliding_window=6))
    path = tmp_path / "gguf" / f"tiny-mistral-{outtype}.gguf"
    path.parent.mkdir()
    convert_with_llama_cpp(tmp_path / "src", path, outtype)
    loaded = load_model(str(path))
    assert loaded.model_config.architecture == "LlamaForCausalLM"
    assert (loaded.model_config.head_dim, loaded.model_config.sliding_window) == (48, None)
    _check(loaded.model, _hf_from_gguf(path))
