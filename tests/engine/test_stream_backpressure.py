"""A consumer that stops reading a stream costs one pending output per request, not one per
step (issue 48 item 3): outputs are cumulative, so a new one replaces the one not yet taken."""

from __future__ import annotations

import asyncio

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.sampling_params import SamplingParams

STEPS = 48


def test_unread_stream_holds_one_merged_output(tiny_llama_dir):
    async def run():
        engine = AsyncLLM(EngineArgs(model=tiny_llama_dir, dtype="float32", max_model_len=256,
                                     kv_cache_memory_bytes="16MiB"), "tiny")
        engine.start()
        try:
            await engine.wait_ready()
            params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
            single = engine.add_request("one", None, params, [1, 2, 3, 4])
            parallel = engine.add_request("many", None, SamplingParams(
                n=4, max_tokens=STEPS, temperature=0.8, seed=1, ignore_eos=True), [1, 2, 3, 4])
            for _ in range(600):  # the consumer reads nothing until both requests finished
                if "one" not in engine._streams and "many" not in engine._streams:
                    break
                assert single.num_pending <= 1 and parallel.num_pending <= 1
                await asyncio.sleep(0.02)
            results = {}
            for name, stream in (("one", single), ("many", parallel)):
                assert stream.num_pending == 1
                results[name] = [out async for out in stream]
            return results
        finally:
            await engine.shutdown()

    results = asyncio.run(run())
    for name, n in (("one", 1), ("many", 4)):
        outs = results[name]
        assert len(outs) == 1, f"{name}: {len(outs)} outputs queued"  # merged into one
        assert outs[0].finished
        assert len(outs[0].outputs) == n
        assert all(len(c.token_ids) == STEPS for c in outs[0].outputs)
