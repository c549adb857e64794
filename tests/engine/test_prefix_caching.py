"""Automatic prefix caching with the model: shared prefixes are computed once, and caching
never changes greedy outputs (the tie-aware rule of DESIGN.md)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from tests.utils import assert_greedy_match, hf_greedy

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _record_scheduled_tokens(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count the tokens the model actually computes per request id (wraps the runner until
    the test ends: the engine may be the session's shared one)."""
    runner = llm.llm_engine.engine_core.runner
    counts: dict[str, int] = {}
    execute = runner.execute

    def counting_execute(scheduler_output):
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            counts[req_id] = counts.get(req_id, 0) + n
        return execute(scheduler_output)

    monkeypatch.setattr(runner, "execute", counting_execute)
    return counts


def _random_ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40000, size=n).tolist()


def test_second_request_computes_only_its_suffix(default_llm, hf_default_model, monkeypatch):
    # The session's default engine (prefix caching on by default); its prompts are its own
    # (random ids from this test's seeds), so nothing of another test's is cached for them.
    llm = default_llm
    counts = _record_scheduled_tokens(llm, monkeypatch)
    prefix = _random_ids(400, seed=7)  # 25 full blocks of 16
    first = prefix + _random_ids(20, seed=8)
    second = prefix + _random_ids(30, seed=9)
    out1 = llm.generate([{"prompt_token_ids": first}], GREEDY, use_tqdm=False)[0]
    out2 = llm.generate([{"prompt_token_ids": second}], GREEDY, use_tqdm=False)[0]
    assert out1.num_cached_tokens == 0
    assert out2.num_cached_tokens == 400
    # Prefill of the second request: its 30-token suffix, then one token per decode step.
    assert counts[out2.request_id] == 30 + (16 - 1)
    assert counts[out1.request_id] == 420 + (16 - 1)
    ref, gaps = hf_greedy(hf_default_model, second, 16)
    assert_greedy_match(out2.outputs[0].token_ids, ref, gaps, "prefix hit")
    # After a reset the same prompt finds nothing cached.
    assert llm.reset_prefix_cache()
    out3 = llm.generate([{"prompt_token_ids": second}], GREEDY, use_tqdm=False)[0]
    assert out3.num_cached_tokens == 0
    # Different cache salts never share blocks; the same salt does.
    salted = [{"prompt_token_ids": second, "cache_salt": s} for s in ("a", "b", "a")]
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in salted]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 400 + 16]
    manager = llm.llm_engine.scheduler.kv_cache_manager
    assert manager.num_free_blocks == llm.llm_engine.config.num_blocks - 1


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_caching_on_and_off_agree_with_hf(tiny_llama_dir, hf_tiny_llama, enable_prefix_caching, monkeypatch):
    llm = LLM(
        tiny_llama_dir, dtype="float32", kv_cache_memory_bytes="8MiB",
        enable_prefix_caching=enable_prefix_caching,
    )
    counts = _record_scheduled_tokens(llm, monkeypatch)
    system_prompts = [_random_ids(100 + 13 * i, seed=100 + i) for i in range(8)]
    prompts = [system_prompts[i % 8] + _random_ids(5 + i, seed=200 + i) for i in range(32)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # Two waves so the second finds the first's blocks cached (a free block keeps its hash).
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], params, use_tqdm=False)
    outs += llm.generate([{"prompt_token_ids": p} for p in prompts[8:]], params, use_tqdm=False)
    for i, (p, out) in enumerate(zip(prompts, outs)):
        ref, gaps = hf_greedy(hf_tiny_llama, p, 12)
        assert_greedy_match(out.outputs[0].token_ids, ref, gaps, f"prompt {i}")
    computed = sum(counts.values())
    cached = sum(o.num_cached_tokens for o in outs)
    if enable_prefix_caching:
        assert cached >= 24 * 96, "the second wave should hit the system prompts' full blocks"
    else:
        assert cached == 0
    assert computed + cached == sum(len(p) + 11 for p in prompts)
    manager = llm.llm_engine.scheduler.kv_cache_manager
    assert manager.num_free_blocks == llm.llm_engine.config.num_blocks - 1
