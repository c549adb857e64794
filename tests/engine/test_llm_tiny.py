"""End to end on a tiny random-weight Llama: our engine against HF transformers, and batching,
chunking and preemption leaving greedy outputs unchanged (the tie-aware rule of DESIGN.md)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from tests.utils import TEXT_PROMPTS, assert_greedy_match, hf_greedy

NUM_STEPS = 32


def _prompts(n: int, vocab: int, seed: int, lo: int = 4, hi: int = 60) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def prompts32(tiny_llama_dir, default_tokenizer):
    prompts = _prompts(31, len(default_tokenizer), seed=1)
    # One long prompt: with max_num_batched_tokens=64 it needs several chunks.
    prompts.append(_prompts(1, len(default_tokenizer), seed=2, lo=300, hi=301)[0])
    return prompts


@pytest.fixture(scope="module")
def hf_refs(hf_tiny_llama, prompts32):
    return [hf_greedy(hf_tiny_llama, p, NUM_STEPS) for p in prompts32]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NUM_STEPS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _assert_all_blocks_free(llm: LLM) -> None:
    manager = llm.llm_engine.scheduler.kv_cache_manager
    assert manager.num_free_blocks == llm.llm_engine.config.num_blocks - 1
    assert not llm.llm_engine.scheduler.has_unfinished_requests()


def test_text_prompts_match_hf(tiny_llama_dir, hf_tiny_llama, default_tokenizer):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes="8MiB")
    texts = TEXT_PROMPTS
    params = SamplingParams(max_tokens=NUM_STEPS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(texts, params, use_tqdm=False)
    for text, out in zip(texts, outs):
        ids = default_tokenizer.encode(text)
        assert out.prompt_token_ids == ids
        ref, gaps = hf_greedy(hf_tiny_llama, ids, NUM_STEPS)
        assert len(out.outputs[0].token_ids) == NUM_STEPS
        assert out.outputs[0].finish_reason == "length"
        assert_greedy_match(out.outputs[0].token_ids, ref, gaps, text)
    _assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "engine_args",
    [
        pytest.param({}, id="batched"),
        pytest.param({"max_num_batched_tokens": 64, "max_num_seqs": 8}, id="chunked"),
        # ~36 blocks of 16 tokens: far less than 32 requests need, so requests are preempted.
        pytest.param({"kv_cache_memory_bytes": 36 * 8192 + 8192, "max_model_len": 512}, id="preempted"),
    ],
)
@pytest.mark.parametrize("kv_cache_backend", ["paged", "vattention"])
def test_batching_does_not_change_greedy(tiny_llama_dir, prompts32, hf_refs, engine_args, kv_cache_backend):
    llm = LLM(
        tiny_llama_dir, dtype="float32", kv_cache_backend=kv_cache_backend,
        **({"kv_cache_memory_bytes": "8MiB"} | engine_args),
    )
    outs = _greedy(llm, prompts32)
    for i, (out, (ref, gaps)) in enumerate(zip(outs, hf_refs)):
        assert len(out) == NUM_STEPS
        assert_greedy_match(out, ref, gaps, f"prompt {i}")
    stats = llm.llm_engine.scheduler.get_stats()
    if "kv_cache_memory_bytes" in engine_args:
        assert stats.num_preemptions > 0, "the tiny pool was meant to force preemption"
    _assert_all_blocks_free(llm)


def test_each_alone_matches_hf(tiny_llama_dir, prompts32, hf_refs):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes="8MiB")
    for i, p in enumerate(prompts32):
        (out,) = _greedy(llm, [p])
        ref, gaps = hf_refs[i]
        assert_greedy_match(out, ref, gaps, f"prompt {i} alone")
    _assert_all_blocks_free(llm)


@pytest.mark.parametrize("kv_cache_backend", ["paged", "vattention"])
def test_seeded_sampling_is_reproducible(tiny_llama_dir, kv_cache_backend):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes="8MiB", kv_cache_backend=kv_cache_backend)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    alone = llm.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(
        ["Hello there", "Another prompt", "And a third one"],
        [params, SamplingParams(max_tokens=16, temperature=1.0), SamplingParams(max_tokens=8, temperature=0.7)],
        use_tqdm=False,
    )
    assert mixed[0].outputs[0].token_ids == alone
    _assert_all_blocks_free(llm)


def test_output_capped_at_max_model_len(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes="8MiB", max_model_len=64)
    out = llm.generate(
        [{"prompt_token_ids": [100] * 56}], SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [100] * 64}], use_tqdm=False)
    _assert_all_blocks_free(llm)


def test_kv_pool_too_small_for_max_model_len_fails_at_startup(tiny_llama_dir):
    # The tiny model: 2 layers x 2 KV heads x 16 dims in float32 is 8 KiB per 16-token block;
    # one request of max_model_len=1024 needs 64 blocks, and block 0 is the null block.
    # (The check is the same for every model; the default model took ~12 s to load for it.)
    with pytest.raises(ValueError, match=r"holds 63 blocks.*kv-cache-memory-bytes.*max-model-len"):
        LLM(tiny_llama_dir, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 * 8192)
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=65 * 8192)
    _assert_all_blocks_free(llm)
