"""Shared test helpers: the tie-aware greedy comparison of DESIGN.md and HF references."""

from __future__ import annotations

import torch

TIE_TOLERANCE = 1e-3

# Eight short text prompts for greedy comparisons on tiny models.
TEXT_PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "1, 2, 3, 4,",
    "Paged attention stores the KV cache in blocks",
    "The quick brown fox",
    "In the beginning",
]


def hf_greedy(
    model, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int] | frozenset = frozenset()
) -> tuple[list[int], list[float]]:
    """Greedy decode with HF transformers' forward and its KV cache, on raw logits.

    Returns (tokens, top-2 logprob gap at each step); stops after a token in stop_ids.
    """
    tokens: list[int] = []
    gaps: list[float] = []
    with torch.inference_mode():
        # Only the last position's logits: a long prompt's full logits are len x vocab (700 x
        # 262144 floats for Gemma 3's long prompt), most of the prefill's time.
        out = model(torch.tensor([prompt_ids]), use_cache=True, logits_to_keep=1)
        for _ in range(max_new_tokens):
            logprobs = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            top2 = logprobs.topk(2)
            token = int(top2.indices[0])
            tokens.append(token)
            gaps.append(float(top2.values[0] - top2.values[1]))
            if token in stop_ids:
                break
            out = model(torch.tensor([[token]]), cache=out.past_key_values, use_cache=True)
    return tokens, gaps


def assert_greedy_match(ours: list, ref: list, ref_gaps: list[float], label: str = "") -> None:
    """DESIGN.md's rule: identical, or first differing at a step where the reference's top-2
    logprobs are within TIE_TOLERANCE (a genuine near-tie); nothing after that step is
    compared. Without such a divergence the lengths must be equal: one side stopping earlier
    (EOS seen by one only, a different max_tokens) is a failure, not a pass."""
    assert len(ref_gaps) >= len(ref), f"{label}: {len(ref_gaps)} reference gaps for {len(ref)} reference tokens"
    for step, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert ref_gaps[step] < TIE_TOLERANCE, (
                f"{label}: greedy tokens diverge at step {step} ({a} vs {b}) where the reference's "
                f"top-2 logprob gap is {ref_gaps[step]:.2e}, not a near-tie\nours={ours}\nref ={ref}"
            )
            return
    assert len(ours) == len(ref), (
        f"{label}: no divergence, but {len(ours)} tokens against the reference's {len(ref)}"
        f"\nours={ours}\nref ={ref}"
    )


def assert_same_greedy(a: list[int], b: list[int], ref_gaps: list[float] | None, label: str = "") -> None:
    """Two runs of our engine (e.g. batched vs alone): identical, or a near-tie divergence."""
    if ref_gaps is None:
        assert a == b, f"{label}: {a} != {b}"
    else:
        assert_greedy_match(a, b, ref_gaps, label)


def tokens_and_gaps(outs) -> tuple[list[list[int]], list[list[float]]]:
    """Each RequestOutput's first completion: its tokens and, per position, the gap between
    its top two logprobs (the request must ask for logprobs >= 2)."""
    tokens, gaps = [], []
    for out in outs:
        completion = out.outputs[0]
        tokens.append(completion.token_ids)
        tops = [sorted((lp.logprob for lp in pos.values()), reverse=True) for pos in completion.logprobs]
        gaps.append([top[0] - top[1] for top in tops])
    return tokens, gaps


def with_float32_scales(w):  # type: ignore[no-untyped-def]
    """A QuantizedWeight with its scales (and zeros) as float32 values off fp16's grid (a
    2^-17 relative nudge), as Q4_K's d * sc products are: the kernels' float32-scale path
    (quantize_int4 / quantize_int8 store float16)."""
    from pagedllm.kernels import QuantizedWeight

    nudge = 1.0 + 2.0**-17
    zeros = None if w.zeros is None else w.zeros.float() * nudge
    return QuantizedWeight(w.bits, w.qweight, w.scales.float() * nudge, zeros)
