"""Phi-3 on tiny random checkpoints of HF's own Phi3ForCausalLM: its cases for the family test
(greedy vs HF in float32, int8 / int4, fused decode), the long rope on a prompt that crosses
`original_max_position_embeddings` at prefill (the family test's short prompts cross it while
decoding), and GGUF files of llama.cpp's "phi3" names (fused attn_qkv and ffn_up, the long
rope's factors as tensors): against HF reading the same file, and kept quantized against the
same file dequantized."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.models.loader import load_model
from tests.models.utils import (
    TINY_BOS_ID,
    TINY_EOS_ID,
    FamilyCase,
    bind_kv_caches,
    prompt_logprobs,
    save_random_model,
    save_tiny_gguf,
)
from tests.utils import assert_greedy_match, hf_greedy

ORIGINAL_CONTEXT = 32
HEAD_DIM = 16  # hidden 64 / 4 heads


def tiny_phi3_config(long_rope: bool = False, sliding_window: int | None = None) -> Any:
    # long_rope: the original context is 32 of 128 positions (scale 4, attention factor
    # sqrt(1 + ln 4 / ln 32) = 1.18); the factors differ per frequency, as real ones do.
    from transformers import Phi3Config

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
    if long_rope:
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.15 * i for i in range(HEAD_DIM // 2)],
            "long_factor": [1.5 + 1.25 * i for i in range(HEAD_DIM // 2)],
            "original_max_position_embeddings": ORIGINAL_CONTEXT,
        }
    return Phi3Config(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        original_max_position_embeddings=ORIGINAL_CONTEXT if long_rope else 128,
        rms_norm_eps=1e-5, rope_parameters=rope, sliding_window=sliding_window,
        bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID, pad_token_id=None,
    )  # fmt: skip


# The family test's prompts are 4 to 12 tokens and it decodes 32: the long-rope case crosses
# the original context of 32 while decoding (HF then rotates each new token with the long
# factors and keeps the short-rotated keys of the prompt); the window of 8 is left by all.
FAMILY_CASES = [
    FamilyCase("phi3", lambda: tiny_phi3_config(sliding_window=8), fused=True, quantized=("int8", "int4")),
    FamilyCase("phi3-longrope", lambda: tiny_phi3_config(long_rope=True), fused=True),
]


@pytest.fixture(scope="module")
def long_rope_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    path = tmp_path_factory.mktemp("phi3-longrope")
    config = tiny_phi3_config(long_rope=True)
    config.vocab_size = 262  # the tiny tokenizer's
    return save_random_model(path, config), path


@pytest.fixture(scope="module")
def long_rope_llm(long_rope_model: tuple[Any, Path]) -> LLM:
    # No prefix caching: each prompt's rotations are its own (layers/longrope.py).
    return LLM(str(long_rope_model[1]), dtype="float32", kv_cache_memory_bytes="8MiB", enable_prefix_caching=False)


def test_long_rope_matches_hf_factors_and_scaling(long_rope_model: tuple[Any, Path]) -> None:
    hf_model, path = long_rope_model
    rotary = load_model(str(path)).model.model.layers[0].self_attn.rotary_emb
    hf_rotary = hf_model.model.rotary_emb
    assert math.isclose(hf_rotary.attention_scaling, math.sqrt(1 + math.log(4) / math.log(ORIGINAL_CONTEXT)))
    x = torch.zeros(1)
    for positions, rows in (([5, 31], [5, 31]), ([5, 31, 32, 100], [128 + 5, 128 + 31, 32, 100])):
        # HF's rows for one forward over `positions` (its set chosen by max + 1) are ours.
        cos, sin = hf_rotary(x, torch.tensor([positions]))
        ours = rotary.cos_sin_cache[torch.tensor(rows)]
        torch.testing.assert_close(ours, torch.cat([cos[0, :, : HEAD_DIM // 2], sin[0, :, : HEAD_DIM // 2]], -1), atol=0, rtol=0)


@pytest.mark.parametrize("prompt_len", [31, 32, 33, 60])
def test_long_rope_prompt_across_the_original_context_matches_hf(
    long_rope_model: tuple[Any, Path], long_rope_llm: LLM, prompt_len: int
) -> None:
    # 31 and 32: short prefill, decodes cross; 33 and 60: the prefill itself is long.
    hf_model, _ = long_rope_model
    llm = long_rope_llm
    prompt = torch.randint(0, 256, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    ref, gaps = hf_greedy(hf_model, prompt, 24)
    assert_greedy_match(out.outputs[0].token_ids, ref, gaps, f"prompt of {prompt_len}")


