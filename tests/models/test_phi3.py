"""Phi-3 on tiny random checkpoints of HF's own Phi3ForCausalLM: its cases for the family test
(greedy vs HF in float32, int8 / int4, fused decode), the long rope on a prompt that crosses
`original_max_position_embeddings` at prefill (the family test's short prompts cross it while
decoding), and GGUF files of llama.cpp's "phi3" names (fused attn_qkv and ffn_up, the long
rope's factors as tensors): against HF reading the same file, and kept quantized against the
same file dequantized."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.models.loader import load_model
from tests.models.utils import (
    TINY_BOS_ID,
    TINY_EOS_ID,
    FamilyCase,
    RequestState,
    allocate_blocks,
    bind_kv_caches,
    make_metadata,
    prompt_logprobs,
    save_random_model,
    save_tiny_gguf,
)
from tests.utils import assert_greedy_match, hf_greedy

ORIGINAL_CONTEXT = 32
HEAD_DIM = 16  # hidden 64 / 4 heads


def tiny_phi3_config(long_rope: bool = False, sliding_window: int | None = None, partial: float = 1.0) -> Any:
    # long_rope: the original context is 32 of 128 positions (scale 4, attention factor
    # sqrt(1 + ln 4 / ln 32) = 1.18); the factors differ per frequency, as real ones do.
    # partial: the rotated fraction of each head (Phi-4-mini: 0.75).
    from transformers import Phi3Config

    pairs = int(HEAD_DIM * partial) // 2
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial}
    if long_rope:
        rope |= {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.15 * i for i in range(pairs)],
            "long_factor": [1.5 + 1.25 * i for i in range(pairs)],
            "original_max_position_embeddings": ORIGINAL_CONTEXT,
        }
    return Phi3Config(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        original_max_position_embeddings=ORIGINAL_CONTEXT if long_rope else 128,
        rms_norm_eps=1e-5, rope_parameters=rope, sliding_window=sliding_window, tie_word_embeddings=partial != 1.0,
        bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID, pad_token_id=None,
    )  # fmt: skip


# The family test's prompts are 4 to 12 tokens and it decodes 32: the long-rope case crosses
# the original context of 32 while decoding (HF then rotates each new token with the long
# factors and keeps the short-rotated keys of the prompt); the window of 8 is left by all.
# Phi-4-mini's shape (a partial rotary, tied embeddings) decodes module by module: the fused
# decode rotates whole heads.
FAMILY_CASES = [
    FamilyCase("phi3", lambda: tiny_phi3_config(sliding_window=8), fused=True, quantized=("int8", "int4")),
    FamilyCase("phi3-longrope", lambda: tiny_phi3_config(long_rope=True), fused=True),
    FamilyCase("phi3-partial-rotary", lambda: tiny_phi3_config(long_rope=True, partial=0.5), fused=False),
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


def test_long_rope_rows_follow_each_requests_own_length(long_rope_model: tuple[Any, Path]) -> None:
    # One step of three requests (decodes first): a decode at position 40 (long, its own
    # row), a chunk of positions 28..35 (length 36 > 32: long, rows past 128 below 32) and a
    # chunk of 0..9 (length 10: short) -- whatever the others in the batch are.
    from pagedllm.attention.metadata import forward_context

    rotary = load_model(str(long_rope_model[1])).model.model.layers[0].self_attn.rotary_emb
    decode = RequestState(list(range(41)), allocate_blocks(41, 16), num_computed_tokens=40)
    long_chunk = RequestState(list(range(36)), allocate_blocks(36, 16, first_block=4), num_computed_tokens=28)
    short = RequestState(list(range(10)), allocate_blocks(10, 16, first_block=7))
    md, _, positions = make_metadata([(decode, 1), (long_chunk, 8), (short, 10)], block_size=16)
    with forward_context(md):
        rows = rotary.cache_rows(positions).tolist()
    assert rows == [40, *(128 + p for p in range(28, 32)), 32, 33, 34, 35, *range(10)]


@pytest.mark.parametrize("prompt_len", [32, 33, 60])
def test_long_rope_prompt_across_the_original_context_matches_hf(
    long_rope_model: tuple[Any, Path], long_rope_llm: LLM, prompt_len: int
) -> None:
    # 32: a short prefill (length 32 is not past 32), then decodes from position 32 on long;
    # 33 and 60: the prefill itself is long.
    hf_model, _ = long_rope_model
    llm = long_rope_llm
    prompt = torch.randint(0, 256, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    ref, gaps = hf_greedy(hf_model, prompt, 24)
    assert_greedy_match(out.outputs[0].token_ids, ref, gaps, f"prompt of {prompt_len}")




def _llama_cpp_phi3_metadata(config: Any) -> Callable[[Any], None]:
    """What llama.cpp's converter adds for phi3: the window (0: none) and, for the long rope,
    the original context, the attention factor and the two factor tensors. (And a padding
    id: transformers' Phi3Config defaults it to 32000, past the tiny vocabulary.)"""

    def extra(writer: Any) -> None:
        writer.add_pad_token_id(TINY_EOS_ID)
        writer.add_sliding_window(config.sliding_window or 0)
        writer.add_rope_dimension_count(HEAD_DIM)
        rope = config.rope_parameters
        if rope["rope_type"] != "longrope":
            return
        scale = config.max_position_embeddings / ORIGINAL_CONTEXT
        writer.add_rope_scaling_orig_ctx_len(ORIGINAL_CONTEXT)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(ORIGINAL_CONTEXT)))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))

    return extra


def _phi3_gguf(tmp_path: Path, config: Any, qtype: str = "Q8_0") -> tuple[Any, Path]:
    """(HF model, GGUF path): a random Phi3ForCausalLM written as llama.cpp's phi3 file."""
    from transformers import AutoTokenizer

    config.vocab_size = 262
    hf_model = save_random_model(tmp_path, config)
    path = tmp_path / "tiny-phi3.gguf"
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    save_tiny_gguf(path, hf_model, tokenizer, qtype, arch="phi3", extra=_llama_cpp_phi3_metadata(config))
    return hf_model, path


def _hf_from_gguf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def _greedy(path: Path, prompt: list[int], **kwargs: Any) -> list[int]:
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes="8MiB", **kwargs)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids


def _logprobs(path: Path, prompt: list[int], quantization: str | None = None) -> tuple[Any, torch.Tensor]:
    loaded = load_model(str(path), quantization=quantization)
    bind_kv_caches(loaded.model, num_blocks=8, block_size=16)
    return loaded, prompt_logprobs(loaded.model, prompt)


def test_gguf_matches_hf_reading_the_same_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # transformers reads a phi3 GGUF's sizes and rope base but neither the long rope nor the
    # window (its phi3 key map has no such keys): a plain Phi-3 is what it can check.
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    _, path = _phi3_gguf(tmp_path, tiny_phi3_config())
    prompt = list(range(3, 43))
    loaded, ours = _logprobs(path, prompt)
    assert (loaded.quantization, loaded.model_config.architecture) == ("gguf", "Phi3ForCausalLM")
    ref_model = _hf_from_gguf(path)
    with torch.inference_mode():
        ref = ref_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    ref_tokens, gaps = hf_greedy(ref_model, prompt, 24)
    assert_greedy_match(_greedy(path, prompt), ref_tokens, gaps, "phi3 GGUF")


def test_long_rope_gguf_kept_quantized_matches_its_dequantized_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The file's long rope and window come back from its metadata and factor tensors; the
    # reference is HF's Phi3ForCausalLM of the original config holding the file's weights
    # dequantized (transformers' own GGUF load of them, which drops the long rope).
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    config = tiny_phi3_config(long_rope=True, sliding_window=24)
    hf_model, path = _phi3_gguf(tmp_path, config, qtype="Q4_0")
    prompt = list(range(3, 43))  # 40 tokens: past the original context of 32
    loaded, ours = _logprobs(path, prompt)
    arch = loaded.model.arch
    assert loaded.quantization == "gguf" and arch.sliding_windows == (24, 24)
    assert {k: arch.rope[k] for k in ("rope_type", "original_max_position_embeddings")} == {
        "rope_type": "longrope", "original_max_position_embeddings": ORIGINAL_CONTEXT,
    }
    _, dequantized = _logprobs(path, prompt, quantization="none")
    torch.testing.assert_close(ours, dequantized, atol=1e-4, rtol=0)
    ref_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ref_model.load_state_dict(_hf_from_gguf(path).state_dict())
    with torch.inference_mode():
        ref = ref_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert (ref - hf_model(torch.tensor([prompt])).logits[0].log_softmax(-1)).abs().max() > 1e-3  # Q4_0 moved it
    ref_tokens, gaps = hf_greedy(ref_model, prompt, 24)
    assert_greedy_match(_greedy(path, prompt, enable_prefix_caching=False), ref_tokens, gaps, "phi3 long-rope GGUF")


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_ranks_take_their_rows_of_each_fused_section(
    long_rope_model: tuple[Any, Path], rank: int
) -> None:
    # Loading needs no process group: each rank's shard of the fused tensors is its half of
    # q, of k and of v (heads), and of gate and of up, not a half of the fused rows.
    from pagedllm.distributed.parallel_state import TPGroup, tensor_parallel

    hf_model, path = long_rope_model
    with tensor_parallel(TPGroup(rank, 2)):
        loaded = load_model(str(path))
    config = hf_model.config
    half = lambda w, dim=0: w.chunk(2, dim=dim)[rank]  # noqa: E731
    for ours, ref in zip(loaded.model.model.layers, hf_model.model.layers):
        sizes = [n * HEAD_DIM for n in (config.num_attention_heads, config.num_key_value_heads, config.num_key_value_heads)]
        q, k, v = ref.self_attn.qkv_proj.weight.split(sizes)
        assert torch.equal(ours.self_attn.qkv_proj.weight, torch.cat([half(q), half(k), half(v)]))
        gate, up = ref.mlp.gate_up_proj.weight.chunk(2)
        assert torch.equal(ours.mlp.gate_up_proj.weight, torch.cat([half(gate), half(up)]))
        assert torch.equal(ours.self_attn.o_proj.weight, half(ref.self_attn.o_proj.weight, dim=1))
        assert torch.equal(ours.mlp.down_proj.weight, half(ref.mlp.down_proj.weight, dim=1))
