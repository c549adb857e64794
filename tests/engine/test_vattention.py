"""The vattention KV backend end to end: what it refuses (clearly), and its memory: resident
pages grow with generated tokens, by the engine's accounting and by /proc/self/smaps, and
fall back once a finished request's pages are reclaimed."""

from __future__ import annotations

import pytest

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.kv_backends.vattention.worker import mapping_rss_bytes


@pytest.fixture(scope="module")
def vattn_llm(tiny_llama_dir):
    # Without deferral, a finished request's pages are released at the next step.
    return LLM(tiny_llama_dir, dtype="float32", max_model_len=512, kv_cache_memory_bytes="4MiB",
               max_num_seqs=4, kv_cache_backend="vattention", vattention_deferred_reclaim=False)


def _rss(llm: LLM) -> int:
    return mapping_rss_bytes(*llm.llm_engine.engine_core.runner.kv_worker.mapping_range)


def test_unsupported_features_are_refused(vattn_llm, tiny_llama_dir):
    with pytest.raises(ValueError, match="n > 1 or beam search.*kv_cache_backend='paged'"):
        vattn_llm.generate(["Hello"], SamplingParams(n=2, max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="n > 1 or beam search"):
        vattn_llm.beam_search(["Hello"], BeamSearchParams(beam_width=2, max_tokens=4))
    with pytest.raises(ValueError, match="prefix caching.*vattention.*enable_prefix_caching"):
        LLM(tiny_llama_dir, dtype="float32", kv_cache_backend="vattention", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="kv_cache_backend='pages' is not one of paged, vattention"):
        LLM(tiny_llama_dir, dtype="float32", kv_cache_backend="pages")
    with pytest.raises(ValueError, match="--speculative-config is not supported with --kv-cache-backend vattention"):
        LLM(tiny_llama_dir, dtype="float32", kv_cache_backend="vattention",
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="--kv-transfer-config is not supported with --kv-cache-backend vattention"):
        LLM(tiny_llama_dir, dtype="float32", kv_cache_backend="vattention",
            kv_transfer_config={"kv_role": "kv_consumer"})
    assert not vattn_llm.llm_engine.config.cache_config.enable_prefix_caching  # off by default
    # The engine still serves requests after refusing (nothing leaked).
    out = vattn_llm.generate(["Hello"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) <= 3
    assert vattn_llm.llm_engine.scheduler.kv_cache_manager.usage == 0.0


def test_resident_memory_grows_with_tokens_and_falls_after_reclaim(vattn_llm):
    engine = vattn_llm.llm_engine
    manager = engine.scheduler.kv_cache_manager
    engine.step()  # flush anything left by an earlier test
    assert manager.resident_bytes == 0 and _rss(vattn_llm) == 0
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    engine.add_request({"prompt_token_ids": list(range(100, 110))}, params)
    seen = []  # (tokens computed, engine's resident bytes, smaps Rss)
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.scheduler.get_stats()
        if engine.has_unfinished_requests() and step % 15 == 0:  # smaps is slow to read
            seen.append((stats.kv_token_bytes, manager.resident_bytes, _rss(vattn_llm)))
        step += 1
    # 2 layers x K/V = 4 regions of 128-byte tokens: a 4 KiB page per region every 32 tokens.
    first, last = seen[0], seen[-1]
    assert first[1] == 4 * 4096 and last[1] == 4 * 4096 * 4  # 11 and 115 tokens
    for token_bytes, resident, rss in seen:
        assert rss == resident, "the engine's page accounting disagrees with the OS"
        assert token_bytes <= resident
    assert [r for _, r, _ in seen] == sorted(r for _, r, _ in seen)
    assert last[0] > first[0]
    # Finished: the next step releases the slot (madvise DONTNEED).
    engine.step()
    assert manager.resident_bytes == 0 and _rss(vattn_llm) == 0
    assert engine.scheduler.get_stats().kv_token_bytes == 0


def test_deferred_reclaim_keeps_pages_for_the_next_request(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=512, kv_cache_memory_bytes="4MiB",
              max_num_seqs=2, kv_cache_backend="vattention")
    manager = llm.llm_engine.scheduler.kv_cache_manager
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": list(range(100, 110))}], params, use_tqdm=False)
    kept = _rss(llm)
    assert kept == manager.resident_bytes > 0  # finished, yet resident (deferred)
    stats = llm.llm_engine.scheduler.get_stats()
    assert stats.kv_token_bytes == 0 and stats.kv_fragmentation == 1.0
    assert manager.num_free_blocks == llm.llm_engine.config.num_blocks - 1  # reclaimable = free
    # The same request again lands in the same slot: no new page, the same tokens.
    again = llm.generate([{"prompt_token_ids": list(range(100, 110))}], params, use_tqdm=False)
    assert _rss(llm) == kept and again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
