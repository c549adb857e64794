"""The default model (Q4_1) with int8 prefill activations against float ones on the same
weights: the logprob drift, stated and bounded (docs/quantization.md)."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import pytest

from pagedllm import kernels
from pagedllm.kernels import INT8_ACTIVATION_MIN_ROWS
from pagedllm.layers.linear import set_prefill_activations

pytestmark = pytest.mark.skipif(
    not kernels.isa_at_least(kernels.cpu_isa(), "avx2") or kernels.quant_linear_ops() is None, reason="the int8-activation kernel is AVX2 code"
)

TEXT = (
    "The sun was setting over the hills as the travellers reached the village. They had walked "
    "all day along the river, and their feet ached. An old woman stood at the gate of the first "
    "house and asked where they had come from. They told her about the long road from the city, "
    "the storm that had caught them on the second night, and the bridge that had washed away."
)
PROMPTS = [
    "Question: What is the capital of France?\nAnswer:",
    "Here is a haiku about the sea:\n",
    "Three fruits that are red:",
    "Romeo and Juliet was written by",
]


@pytest.fixture
def engine(default_llm: Any) -> Iterator[tuple[Any, Any]]:
    """The session's default engine and its model, put back to float activations after."""
    model = default_llm.llm_engine.engine_core.runner.model
    try:
        yield default_llm, model
    finally:
        set_prefill_activations(model, "float")


def _prompt_logprobs(llm: Any, salt: str) -> tuple[np.ndarray, list[dict]]:
    from pagedllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=5, temperature=0.0)
    # A salt per mode: the second run must not take the first one's KV from the prefix cache.
    [out] = llm.generate([{"prompt": TEXT + " " + TEXT, "cache_salt": salt}], params, use_tqdm=False)
    ids = out.prompt_token_ids
    assert len(ids) >= INT8_ACTIVATION_MIN_ROWS  # one chunk of this many rows takes the int8 kernel
    positions = out.prompt_logprobs[1:]
    return np.array([pos[t].logprob for pos, t in zip(positions, ids[1:])]), positions


def prompt_drift(llm: Any, model: Any, mode: str) -> tuple[np.ndarray, int, int, float]:
    """TEXT's prompt logprobs with `mode` activations against float ones on the same engine:
    (|diff| per position, positions whose argmax agrees, positions, perplexity ratio)."""
    set_prefill_activations(model, "float")
    ref, ref_top = _prompt_logprobs(llm, "float-activations")
    assert set_prefill_activations(model, mode) > 0
    got, got_top = _prompt_logprobs(llm, f"{mode}-activations")
    return drift_stats(ref, ref_top, got, got_top, f"{mode} prefill")


def drift_stats(ref: np.ndarray, ref_top: list[dict], got: np.ndarray, got_top: list[dict],
                label: str) -> tuple[np.ndarray, int, int, float]:
    """Two runs' prompt logprobs of the same tokens (and their top-k per position) compared:
    (|diff| per position, positions whose argmax agrees, positions, perplexity ratio), printed."""
    diff = np.abs(got - ref)
    argmax_same = sum(
        max(a, key=lambda t: a[t].logprob) == max(b, key=lambda t: b[t].logprob) for a, b in zip(ref_top, got_top)
    )
    ppl_ratio = float(np.exp(-got.mean()) / np.exp(-ref.mean()))
    print(f"{label}: logprob |diff| max {diff.max():.3f} mean {diff.mean():.4f}; ppl ratio {ppl_ratio:.4f}; "
          f"argmax same {argmax_same}/{len(ref_top)}")  # fmt: skip
    return diff, argmax_same, len(ref_top), ppl_ratio


def greedy_identical(llm: Any, model: Any, prompts: list[str], mode: str, drift_bound: float,
                     max_tokens: int, min_rows: int | None = None) -> int:
    """Greedy continuations of `prompts` with float and with `mode` activations (from
    `min_rows` rows up; a salt per mode keeps the prefix cache out); asserts the tie rule at
    the drift's scale and returns how many are identical. Each logprob moves by at most
    drift_bound, so two tokens can swap only where float's top two were within twice that."""
    from pagedllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, ignore_eos=True)
    runs = []
    for m in ("float", mode):
        set_prefill_activations(model, m, min_rows=min_rows)
        outs = llm.generate([{"prompt": p, "cache_salt": m} for p in prompts], greedy, use_tqdm=False)
        runs.append([o.outputs[0] for o in outs])
    identical = 0
    for ref, ours in zip(*runs):
        a, b = list(ref.token_ids), list(ours.token_ids)
        identical += a == b
        if a != b:
            step = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            top2 = sorted((lp.logprob for lp in ref.logprobs[step].values()), reverse=True)[:2]
            print(f"{mode} diverges at step {step}, float top-2 gap {top2[0] - top2[1]:.3f}")
            assert top2[0] - top2[1] < 2 * drift_bound
    print(f"{mode} greedy identical {identical}/{len(prompts)}")
    return identical


def test_int8_prefill_logprob_drift(engine: tuple[Any, Any]) -> None:
    llm, model = engine
    diff, argmax_same, positions, ppl_ratio = prompt_drift(llm, model, "int8")
    # Measured (155 positions, Q4_1 default model): max 0.53, mean 0.070, ppl +0.34%, argmax
    # the same at 148 of 155 positions. The activations' rounding is half a step of absmax /
    # 127 per group of 32, a relative perturbation of ~0.2-0.4% per matmul input, compounding
    # over 30 layers x 4 projections; llama.cpp's Q8 activations round the same way.
    assert diff.max() < 1.0 and diff.mean() < 0.15
    assert abs(ppl_ratio - 1) < 0.02
    assert argmax_same >= 0.9 * positions
    assert diff.max() > 1e-3  # the int8 kernel did run


def test_int8_prefill_greedy(engine: tuple[Any, Any]) -> None:
    # Short prompts: int8 from the first row so their prefill takes it (decode steps run the
    # fused float decode either way). The tie rule at twice the drift bound (1.0): int8
    # rounding makes which tokens swap sensitive to float32-ulp changes upstream (a decode
    # attention kernel ~2e-7 from the old one, float outputs identical, moved one prompt's
    # parting from a top-two gap of 0.23 to 1.03).
    llm, model = engine
    identical = greedy_identical(llm, model, PROMPTS, "int8", drift_bound=1.0, max_tokens=16, min_rows=1)
    # How many stay identical moves with those flips (2/4 and 3/4 with the earlier attention
    # kernel, 1/4 with the current one): at least one; the drift test above bounds the
    # statistics over 155 positions.
    assert identical >= 1


def test_prefill_activations_engine_arg(tiny_llama_dir: Any) -> None:
    import argparse

    from pagedllm import LLM
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.layers.linear import Linear

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args(["--prefill-activations", "int8"])).matmul_activations == "int8"
    assert EngineArgs.from_cli_args(parser.parse_args([])).matmul_activations == "auto"
    llm = LLM(str(tiny_llama_dir), quantization="int4", matmul_activations="int8", kv_cache_memory_bytes="16MiB")
    layers = [m for m in llm.llm_engine.engine_core.runner.model.modules() if isinstance(m, Linear)]
    assert layers and all(m.int8_min_rows == INT8_ACTIVATION_MIN_ROWS for m in layers)
    with pytest.raises(ValueError, match="tensor-parallel-size 1"):
        LLM(str(tiny_llama_dir), matmul_activations="int8", tensor_parallel_size=2)
