"""KV offload tiers behind the prefix cache (docs/kv_offload.md): blocks evicted from a small
pool come back from host memory or from disk instead of being recomputed, and outputs are
the same as with the tiers off; the disk tier survives a new engine and refuses corrupt,
truncated and foreign files."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)
POOL = "256KiB"  # the tiny Llama: 2 layers x 2 KV heads x 16 dims, float32: 8 KiB a block of 16


def _ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40000, size=n).tolist()


def _llm(model_dir: str, **kwargs) -> LLM:
    return LLM(model_dir, dtype="float32", kv_cache_memory_bytes=POOL, max_model_len=448, **kwargs)


def _computed(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Tokens the model computes per request id."""
    runner = llm.llm_engine.engine_core.runner
    counts: dict[str, int] = {}
    execute = runner.execute

    def counting(so):
        for req_id, n in so.num_scheduled_tokens.items():
            counts[req_id] = counts.get(req_id, 0) + n
        return execute(so)

    monkeypatch.setattr(runner, "execute", counting)
    return counts


def _run(llm: LLM, prompt: list[int], params: SamplingParams):
    return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]


def _evict_all(llm: LLM) -> None:
    """Fill the pool with other prompts, so every cached block of earlier ones is evicted."""
    for seed in range(3):
        _run(llm, _ids(400, seed=900 + seed), GREEDY)


def _store(llm: LLM):
    return llm.llm_engine.scheduler.kv_cache_manager.offload


PROMPT = _ids(300, seed=5)  # 18 full blocks and a partial one


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_cpu_tier_reloads_evicted_prefix(tiny_llama_dir, params, monkeypatch):
    off = _llm(tiny_llama_dir)
    first_off = _run(off, PROMPT, params)
    _evict_all(off)
    again_off = _run(off, PROMPT, params)
    assert again_off.num_cached_tokens == 0  # the small pool lost it: recomputed
    del off

    on = _llm(tiny_llama_dir, kv_offload_cpu_bytes="4MiB")
    counts = _computed(on, monkeypatch)
    first = _run(on, PROMPT, params)
    _evict_all(on)
    again = _run(on, PROMPT, params)
    assert again.num_cached_tokens == 288  # every full block but the last token's, from the CPU tier
    assert counts[again.request_id] == 300 - 288 + params.max_tokens - 1
    assert first.outputs[0].token_ids == first_off.outputs[0].token_ids
    assert again.outputs[0].token_ids == again_off.outputs[0].token_ids == first.outputs[0].token_ids
    stats = _store(on).take_stats()
    assert stats["cpu"]["hits"] >= 18 and stats["cpu"]["stores"] >= 18
