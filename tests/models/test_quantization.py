"""Weight-only quantization: the kernels, GGUF block decoding, loading, and quality on the
default model against its dequantized float32 self."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pagedllm.kernels import (
    INT16_MAX_ROWS,
    PANEL_MAX_ROWS,
    TILE_MAX_ROWS,
    QuantizedWeight,
    embedding_lookup,
    quantize_int4,
    quantize_int8,
    quantized_linear,
)
from pagedllm.models.gguf_quant import gguf_quantized_weight
from pagedllm.models.loader import load_model
from tests.models.test_llama import PROMPT
from tests.models.test_loader import cache_dir, tiny_hf, write_gguf  # noqa: F401  (fixtures)
from tests.models.utils import bind_kv_caches, prompt_logprobs
from tests.utils import assert_greedy_match, with_float32_scales


def _weight(bits: int, n: int = 83, k: int = 96, seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    return (quantize_int8 if bits == 8 else quantize_int4)(torch.randn(n, k, generator=gen))


@pytest.mark.parametrize("scales", ["float16", "float32"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    "num_rows", [1, 3, 4, 5, 9, TILE_MAX_ROWS, TILE_MAX_ROWS + 1, 40, PANEL_MAX_ROWS, PANEL_MAX_ROWS + 1]
)
def test_quantized_linear_matches_dequantized_matmul(bits: int, num_rows: int, scales: str) -> None:
    # Every kernel (int16 activations, 8-row tiles, dequantized panels, then dequantize + GEMM)
    # and the tails of their tiles (83 weight rows: a last panel of 3, an odd row), with the
    # scales float16 (as quantize and GGUF Q4_1 / Q8_0 store them) and float32 (Q4_K).
    weight = _weight(bits)
    if scales == "float32":
        weight = with_float32_scales(weight)
    assert weight.scales.dtype == getattr(torch, scales)
    n = weight.shape[0]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_rows, 96, generator=gen)
    bias = torch.randn(n, generator=gen)
    want = torch.nn.functional.linear(x, weight.dequantize(), bias)
    got = quantized_linear(x, weight, bias)
    if num_rows <= INT16_MAX_ROWS:
        # int16 activations: each x off by at most half a step (group max / 65534), so each
        # output by at most sum |w| * step / 2 over its row.
        step = x.view(num_rows, -1, 32).abs().amax(-1) / 32767  # [M, groups]
        bound = (weight.dequantize().abs().view(n, -1, 32).sum(-1) @ step.T).T / 2  # [M, N]
        assert bool(((got - want).abs() <= bound + 1e-5).all()), (got - want).abs().max()
    else:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    got_bf16 = quantized_linear(x.bfloat16(), weight)
    assert got_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(got_bf16.float(), want - bias, atol=0.1, rtol=0.02)


def test_quantize_rounds_to_the_nearest_level() -> None:
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    for qw in (quantize_int8(w), quantize_int4(w)):
        step = qw.scales.repeat_interleave(32, dim=1)  # [N, K]: the spacing of the levels
        assert bool(((qw.dequantize() - w).abs() <= step / 2 + 1e-6).all())
    assert quantize_int8(w).qweight.dtype == torch.int8
    assert quantize_int4(w).qweight.shape == (16, 32)  # two 4-bit values per byte


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_decode_like_gguf(type_name: str) -> None:
    import gguf
    from gguf.quants import dequantize, quantize

    qtype = gguf.GGMLQuantizationType[type_name]
    w = np.random.default_rng(3).standard_normal((24, 128)).astype(np.float32)
    raw = quantize(w, qtype)
    qw = gguf_quantized_weight(raw, type_name, (24, 128))
    np.testing.assert_allclose(qw.dequantize().numpy(), dequantize(raw, qtype), atol=1e-5, rtol=1e-6)
    # The file's fp16 d (and m; Q4_0's -8 d, exact) stay fp16: the file's bytes a group, plus
    # Q4_0's zero (2 bytes a group: the 4-bit kernels are Q4_1's).
    assert qw.scales.dtype == torch.float16
    assert qw.nbytes == raw.nbytes + (2 * qw.scales.numel() if type_name == "Q4_0" else 0)


def test_gguf_q4_0_past_fp16s_range_keeps_float32() -> None:
    # -8 d overflows fp16 for d > 8188: the zeros (and scales) are then float32, still exact.
    import gguf
    from gguf.quants import dequantize

    raw = np.zeros((2, 18), dtype=np.uint8)
    raw[:, 0:2] = np.array([[10000.0], [0.5]], dtype=np.float16).view(np.uint8)
    raw[:, 2:] = np.arange(16, dtype=np.uint8)
    qw = gguf_quantized_weight(raw, "Q4_0", (2, 32))
    assert qw.scales.dtype == torch.float32
    np.testing.assert_array_equal(qw.dequantize().numpy(), dequantize(raw, gguf.GGMLQuantizationType.Q4_0))


def test_q4_k_blocks_decode_like_gguf() -> None:
    import gguf
    from gguf.quants import dequantize

    # gguf cannot quantize to Q4_K; random super-blocks (with finite fp16 d, dmin) do as well.
    rng = np.random.default_rng(4)
    n, k = 6, 512
    raw = rng.integers(0, 256, size=(n, k // 256, 144), dtype=np.uint8)
    raw[..., 0:4] = rng.uniform(0.001, 0.05, size=(n, k // 256, 2)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(n, -1)
    qw = gguf_quantized_weight(raw, "Q4_K", (n, k))
    assert qw.scales.dtype == torch.float32  # d * sc needs float32's mantissa
    want = dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    np.testing.assert_allclose(qw.dequantize().numpy(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_gguf_kept_quantized_matches_dequantized(
    tiny_hf: tuple[Any, Path], cache_dir: Path, qtype: str  # noqa: F811
) -> None:
    # The quantized layers compute with exactly the dequantized weights, Q/K rows permuted
    # back as the float path does.
    path = write_gguf(tiny_hf, qtype)
    quantized = load_model(str(path))  # the default for a file of supported types
    assert quantized.quantization == "gguf"
    layer = quantized.model.model.layers[0]
    if qtype == "Q8_0":  # kept as the file's blocks
        assert layer.self_attn.qkv_proj.blocks.type_name == "Q8_0"
    else:
        assert layer.self_attn.qkv_proj.quant.bits == 4
    assert quantized.model.model.embed_tokens.blocks.type_name == "Q8_0"  # the writer's Q8_0 embedding
    dense = load_model(str(path), quantization="none")
    assert quantized.weight_bytes < dense.weight_bytes / 2.5
    logprobs = []
    for loaded in (quantized, dense):
        bind_kv_caches(loaded.model, num_blocks=8, block_size=16)
        logprobs.append(prompt_logprobs(loaded.model, PROMPT))
    # Q8_0 blocks (matrices, and the Q8_0 head of both files) multiply through the small-M
    # kernel's int16 activations: within its rounding
    torch.testing.assert_close(logprobs[0], logprobs[1], atol=1e-3, rtol=0)


def test_quantize_at_load(tiny_hf: tuple[Any, Path]) -> None:  # noqa: F811
    _, hf_dir = tiny_hf
    results = {}
    for method in ("none", "int8", "int4"):
        loaded = load_model(str(hf_dir), quantization=method)
        assert loaded.quantization == method
        bind_kv_caches(loaded.model, num_blocks=8, block_size=16)
        results[method] = (prompt_logprobs(loaded.model, PROMPT), loaded.weight_bytes)
    (ref, dense_bytes), (q8, q8_bytes), (q4, q4_bytes) = results["none"], results["int8"], results["int4"]
    assert q4_bytes < q8_bytes < dense_bytes / 2.5
    # Measured on this tiny random model (weights N(0, 0.2), peaky logits): int8 0.054,
    # int4 0.87 at most (a weight's 4-bit rounding is up to 1/30 of its group's range).
    q8_diff, q4_diff = float((q8 - ref).abs().max()), float((q4 - ref).abs().max())
    print(f"int8 {q8_diff:.3f} int4 {q4_diff:.3f}")
    assert q8_diff < 0.1
    assert q4_diff < 1.5
    assert q4_diff > q8_diff  # int4 is the coarser


def test_quantization_errors(tiny_hf: tuple[Any, Path], cache_dir: Path) -> None:  # noqa: F811
    _, hf_dir = tiny_hf
    with pytest.raises(ValueError, match="quantization='fp8' is not supported; supported: gguf, int8"):
        load_model(str(hf_dir), quantization="fp8")
    with pytest.raises(ValueError, match="needs a .gguf checkpoint"):
        load_model(str(hf_dir), quantization="gguf")
    # Q5_0 (and every other kept type) stays as the file's blocks: no whole-model fallback.
    path = write_gguf(tiny_hf, "Q5_0")
    loaded = load_model(str(path))
    assert loaded.quantization == "gguf"
    assert loaded.model.model.layers[0].self_attn.qkv_proj.blocks.type_name == "Q5_0"


# --- the real default model -------------------------------------------------------------

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "List three fruits that are red.",
    "How do I reverse a list in Python?",
    "What is 12 times 7?",
    "Give me a tip for sleeping better.",
    "Who wrote Romeo and Juliet?",
]
TEXT = (
    "The sun was setting over the hills as the travellers reached the village. They had walked "
    "all day along the river, and their feet ached. An old woman stood at the gate of the first "
    "house and asked where they had come from. They told her about the long road from the city, "
    "the storm that had caught them on the second night, and the bridge that had washed away."
)


def _first_divergence(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def _run(quantization: str, llm: Any = None) -> tuple[list[list[int]], list[list[float]], float, list[float]]:
    """Greedy outputs, top-2 gaps, perplexity of TEXT and its per-token logprobs, on ``llm``
    or on a new engine loading the default model with ``quantization``."""
    from pagedllm import LLM, SamplingParams

    if llm is None:
        llm = LLM("SmolLM2-135M-Instruct", dtype="float32", quantization=quantization,
                  max_model_len=1024, kv_cache_memory_bytes="64MiB")  # fmt: skip
    # The engine-wide prefix-cache keys end with the weight format the model loaded with.
    assert llm.llm_engine.scheduler.kv_cache_manager.hash_extra_keys[-1] == quantization
    greedy = SamplingParams(temperature=0.0, max_tokens=48, logprobs=2, ignore_eos=True)
    outs = llm.chat([[{"role": "user", "content": c}] for c in CHATS], greedy, use_tqdm=False)
    tokens, gaps = [], []
    for out in outs:
        completion = out.outputs[0]
        tokens.append(list(completion.token_ids))
        top2 = [sorted((lp.logprob for lp in pos.values()), reverse=True)[:2] for pos in completion.logprobs]
        gaps.append([a - b for a, b in top2])
    ppl_params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    [text_out] = llm.generate([TEXT], ppl_params, use_tqdm=False)
    ids = text_out.prompt_token_ids
    token_logprobs = [pos[t].logprob for pos, t in zip(text_out.prompt_logprobs[1:], ids[1:])]
    manager = llm.llm_engine.scheduler.kv_cache_manager
    assert manager.num_free_blocks == llm.llm_engine.config.num_blocks - 1, "blocks left behind"
    return tokens, gaps, math.exp(-sum(token_logprobs) / len(token_logprobs)), token_logprobs


@pytest.mark.slow
def test_default_model_quantized_quality(default_llm: Any) -> None:
    ref_tokens, ref_gaps, ref_ppl, ref_lp = _run("none")  # the Q4_1 file dequantized to float32
    for method in ("gguf", "int8"):
        # gguf is the default for the Q4_1 file: the session's default engine is that one.
        tokens, _, ppl, lp = _run(method, default_llm if method == "gguf" else None)
        lp_diff = np.abs(np.array(lp) - np.array(ref_lp))
        identical = sum(a == b for a, b in zip(tokens, ref_tokens))
        print(f"{method}: ppl {ppl:.4f} vs {ref_ppl:.4f}; logprob diff max {lp_diff.max():.2e} "
              f"mean {lp_diff.mean():.2e}; identical greedy {identical}/8")  # fmt: skip
        assert abs(ppl / ref_ppl - 1) < 0.01
        if method == "gguf":
            # Q4_1 kept quantized computes with the same weights: float32 agreement.
            assert lp_diff.max() < 1e-3
            for ours, ref, gaps in zip(tokens, ref_tokens, ref_gaps):
                assert_greedy_match(ours, ref, gaps, "gguf vs dequantized")
        else:
            # Q8_0 (int8, per group of 32) requantizes the Q4_1 weights: close, not equal.
            # Measured: ppl +0.65%, logprob diff max 0.14, mean 0.034; 5 of 8 identical.
            assert lp_diff.max() < 0.25 and lp_diff.mean() < 0.05
            assert identical >= 5
            # The others part where the float model's top two were close: a perturbation
            # of the logits of that size flips them, and the texts then go their own ways.
            for ours, ref, gaps in zip(tokens, ref_tokens, ref_gaps):
                if ours != ref:
                    step = _first_divergence(ours, ref)
                    print(f"int8 diverges at step {step}, float top-2 gap {gaps[step]:.3f}")
                    assert gaps[step] < 0.5


def test_quantization_cli_flag() -> None:
    import argparse

    from pagedllm.engine.arg_utils import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args(["--quantization", "int4"])).quantization == "int4"
    assert EngineArgs.from_cli_args(parser.parse_args([])).quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "awq"])


# The default model's resident weights against its file size: test_smollm2.py, on that
# module's own load (no other load of the default model for it).


def test_scales_are_fp16_where_exact_and_float32_elsewhere() -> None:
    # quantize_int4 / quantize_int8 store fp16 scales and mins (Q4_1's and Q8_0's 20 and 34
    # bytes a group) and round the codes against them; weights so small that a scale would
    # be subnormal in fp16, or so large that it overflows, keep float32.
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    for qw in (quantize_int8(w), quantize_int4(w)):
        assert qw.scales.dtype == torch.float16
        assert qw.zeros is None or qw.zeros.dtype == torch.float16
        assert qw.nbytes == qw.qweight.nbytes + 2 * qw.scales.numel() * (1 if qw.zeros is None else 2)
    assert quantize_int4(w).nbytes == 8 * 64 // 32 * 20  # Q4_1's block size
    for extreme in (w * 1e-5, w * 1e8):
        for qw in (quantize_int8(extreme), quantize_int4(extreme)):
            assert qw.scales.dtype == torch.float32
            step = qw.scales.repeat_interleave(32, dim=1)
            assert bool(((qw.dequantize() - extreme).abs() <= step / 2 * (1 + 1e-5)).all())
    with pytest.raises(ValueError, match="scales' dtype"):
        QuantizedWeight(4, quantize_int4(w).qweight, quantize_int4(w).scales, quantize_int4(w).zeros.float())


@pytest.mark.parametrize("scales", ["float16", "float32"])
@pytest.mark.parametrize("bits", [4, 8])
def test_embedding_lookup_is_the_dequantized_rows(bits: int, scales: str) -> None:
    # The compiled gather (one call a step) against the torch formulation, repeated ids and
    # the table's first and last rows included; a prefill's many ids take the threads.
    weight = _weight(bits, n=300, k=96)
    if scales == "float32":
        weight = with_float32_scales(weight)
    for ids in (torch.tensor([7]), torch.tensor([299, 0, 7, 7]), torch.randint(0, 300, (100,))):
        got = embedding_lookup(ids, weight, torch.float32)
        assert torch.equal(got, weight.rows(ids).dequantize())
        assert embedding_lookup(ids, weight, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="out of range"):
        embedding_lookup(torch.tensor([300]), weight, torch.float32)
