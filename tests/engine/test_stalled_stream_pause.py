"""Backpressure (issue 48): a request whose consumer stops reading leaves the core's batch
after ``stalled_stream_timeout_s`` (keeping its KV blocks), rejoins it when read again with
the output an unpaused run gives, and is aborted, every block freed, once paused past
``stalled_stream_abort_timeout_s``."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM, RequestTimeoutError
from pagedllm.sampling_params import SamplingParams

TOKENS = 400
PROMPT = [1, 2, 3, 4]


def _engine(tiny_llama_dir, **kwargs) -> AsyncLLM:
    return AsyncLLM(EngineArgs(model=tiny_llama_dir, dtype="float32", max_model_len=512,
                               kv_cache_memory_bytes="16MiB"), "tiny", **kwargs)


async def _wait_usage(engine: AsyncLLM, done, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        usage = await engine._call_utility("kv_usage")
        if done(usage):
            return usage
        assert time.monotonic() < deadline, usage
        await asyncio.sleep(0.05)


def _greedy(max_tokens: int = TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def test_stalled_stream_is_paused_then_resumed_with_identical_output(tiny_llama_dir):
    async def run():
        engine = _engine(tiny_llama_dir, stalled_stream_timeout_s=0.2)
        engine.start()
        try:
            await engine.wait_ready()
            reference = [out async for out in engine.add_request("ref", None, _greedy(), PROMPT)][-1]
            stalled = engine.add_request("stalled", None, _greedy(), PROMPT)
            first = await stalled.__anext__()  # read once, then stop reading
            assert not first.finished
            usage = await _wait_usage(engine, lambda u: u["num_paused"] == 1)
            assert usage["num_running"] == 0 and usage["kv_blocks_used"] > 0  # out of the batch, blocks kept
            paused_tokens = len(stalled._pending.outputs[0].token_ids) if stalled._pending else 0
            # Another request runs to its end while the stalled one waits.
            other = [out async for out in engine.add_request("other", None, _greedy(64), PROMPT)][-1]
            assert len(other.outputs[0].token_ids) == 64
            await asyncio.sleep(0.3)
            still = len(stalled._pending.outputs[0].token_ids) if stalled._pending else 0
            assert still == paused_tokens, "a paused request kept generating"
            assert paused_tokens < TOKENS
            rest = [out async for out in stalled]  # reading again resumes it
            usage = await _wait_usage(engine, lambda u: u["num_paused"] == 0 and u["num_running"] == 0)
            return reference, rest[-1], usage
        finally:
            await engine.shutdown()

    reference, resumed, usage = asyncio.run(run())
    assert resumed.finished
    assert resumed.outputs[0].token_ids == reference.outputs[0].token_ids
    assert resumed.outputs[0].text == reference.outputs[0].text
    assert usage["kv_blocks_used"] == 0


def test_stream_paused_past_the_abort_limit_is_aborted_and_frees_its_blocks(tiny_llama_dir):
    async def run():
        engine = _engine(tiny_llama_dir, stalled_stream_timeout_s=0.2, stalled_stream_abort_timeout_s=1.0)
        engine.start()
        try:
            await engine.wait_ready()
            stalled = engine.add_request("stalled", None, _greedy(), PROMPT)
            await stalled.__anext__()
            await _wait_usage(engine, lambda u: u["num_paused"] == 1)
            usage = await _wait_usage(engine, lambda u: u["num_paused"] == 0)
            assert "stalled" not in engine._streams
            with pytest.raises(RequestTimeoutError, match="stalled-stream-abort-timeout"):
                async for _ in stalled:
                    pass
            return await _wait_usage(engine, lambda u: u["kv_blocks_used"] == 0, 5.0), usage
        finally:
            await engine.shutdown()

    final, usage = asyncio.run(run())
    assert final["num_running"] == final["num_waiting"] == final["num_paused"] == 0
