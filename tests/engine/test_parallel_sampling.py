"""n > 1 end to end on the tiny model: one group sharing the prompt's KV blocks (counted),
each sequence equal to a lone request with seed + i (so copy-on-write copied the right KV),
every block free at the end, and preemption of groups not changing seeded outputs."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams

BLOCK_SIZE = 16
TINY_BLOCK_BYTES = 2 * 2 * 16 * 4 * 2 * BLOCK_SIZE  # K+V, 2 kv heads, head_dim 16, fp32, 2 layers


def _llm(path: str, num_blocks: int, max_model_len: int = 1024) -> LLM:
    return LLM(path, dtype="float32", max_model_len=max_model_len, block_size=BLOCK_SIZE,
               kv_cache_memory_bytes=num_blocks * TINY_BLOCK_BYTES, max_num_batched_tokens=256,
               max_num_seqs=16)


@pytest.fixture(scope="module")
def big_llm(tiny_llama_dir):
    return _llm(tiny_llama_dir, 1024)


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40000, size=n).tolist()


def _all_free(llm: LLM) -> bool:
    kv = llm.llm_engine.scheduler.kv_cache_manager
    return kv.num_free_blocks == kv.num_blocks - 1


def test_n8_on_1000_token_prompt_holds_prompt_blocks_once(big_llm):
    engine = big_llm.llm_engine
    kv = engine.scheduler.kv_cache_manager
    prompt = _prompt(1000, seed=0)
    params = SamplingParams(n=8, max_tokens=6, seed=11, ignore_eos=True)
    engine.add_request({"prompt_token_ids": prompt}, params, request_id="g")
    child_ids = [f"{i}_g" for i in range(8)]
    figures = None
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
        if figures is None and all(kv.get_num_blocks(c) for c in child_ids):
            # Just after the fork: 999 prompt tokens = 62 full blocks, shared by all eight;
            # each sequence then owns one block for positions 992.. (7 were copied on write).
            figures = (kv.get_num_distinct_blocks(child_ids), [kv.get_kv_figures(c) for c in child_ids])
    num_full = 999 // BLOCK_SIZE
    assert figures[0] == num_full + 8, figures[0]  # not 8 * 63 = 504
    assert all(f.num_blocks == num_full + 1 and f.num_shared_blocks == num_full for f in figures[1])
    assert final.finished and [c.index for c in final.outputs] == list(range(8))
    assert all(len(c.token_ids) == 6 for c in final.outputs)
    assert _all_free(big_llm)

    # Each sequence equals a lone request seeded with seed + i (the CoW'd KV is right).
    lone = big_llm.generate(
        [{"prompt_token_ids": prompt}] * 8,
        [SamplingParams(max_tokens=6, seed=11 + i, ignore_eos=True) for i in range(8)],
        use_tqdm=False,
    )
    assert [c.token_ids for c in final.outputs] == [o.outputs[0].token_ids for o in lone]
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1


def test_group_preemption_gives_same_outputs(big_llm, tiny_llama_dir):
    prompts = [{"prompt_token_ids": _prompt(300, seed=s)} for s in (1, 2)]
    params = [SamplingParams(n=4, max_tokens=32, seed=s, ignore_eos=True, logprobs=2) for s in (3, 4)]
    ref = big_llm.generate(prompts, params, use_tqdm=False)
    # 54 usable blocks: each group ends holding 18 shared + 4 x 3 own blocks = 30; both cannot fit.
    small = _llm(tiny_llama_dir, 55, max_model_len=512)
    got = small.generate(prompts, params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    for r, g in zip(ref, got):
        assert [c.token_ids for c in r.outputs] == [c.token_ids for c in g.outputs]
        assert [c.cumulative_logprob for c in r.outputs] == pytest.approx(
            [c.cumulative_logprob for c in g.outputs], abs=1e-3
        )
    assert _all_free(small)


def test_abort_of_a_group_frees_its_blocks(big_llm):
    engine = big_llm.llm_engine
    prompt = _prompt(20, seed=5)
    engine.add_request({"prompt_token_ids": prompt}, SamplingParams(n=3, max_tokens=50, seed=1), request_id="x")
    engine.step()
    engine.step()
    engine.abort_request(["x"])
    assert not engine.has_unfinished_requests()
    engine.step()  # flushes the finished ids to the runner
    assert _all_free(big_llm)
