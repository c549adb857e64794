"""Cost of the dashboard's KV snapshot against the engine's step time, at full load.

Runs the real engine core in process (the same construction as the server's core process)
over a workload that keeps the running batch full -- many requests over a few shared
prefixes, some with n > 1 -- and after every step takes a snapshot the way the core process
does for `GET /dashboard/state` (build, then pickle for the ZMQ socket), timing both. A
viewer asks for at most 5 snapshots a second, so the per-step comparison is the worst case.

    pagedllm bench dashboard-snapshot --num-requests 64 --max-num-seqs 64
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-memory-bytes", default="4GiB")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-steps", type=int, default=200)


def run(args: argparse.Namespace) -> None:
    from pagedllm.core.kv_snapshot import take_kv_snapshot
    from pagedllm.engine.core_builder import build_engine_core
    from pagedllm.engine.llm_engine import child_params
    from pagedllm.entrypoints.engine_flags import engine_config
    from pagedllm.request import Request
    from pagedllm.sampling_params import SamplingParams

    built = build_engine_core(engine_config(
        model=args.model, dtype=args.dtype, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_num_seqs=args.max_num_seqs, max_model_len=2048,
    ))
    core, scheduler = built.engine_core, built.scheduler
    rng = random.Random(0)
    prefixes = [[rng.randrange(1000, 40000) for _ in range(args.prompt_len // 2)] for _ in range(4)]
    for i in range(args.num_requests):
        prompt = rng.choice(prefixes) + [rng.randrange(1000, 40000) for _ in range(args.prompt_len // 2)]
        params = SamplingParams(max_tokens=args.output_len, temperature=1.0, seed=i, ignore_eos=True,
                                n=3 if i % 8 == 0 else 1)
        # A group as the engine builds it: the leader, the others pending a fork.
        seqs = [Request(f"{k}_r{i}", prompt, child_params(params, k), max_tokens=args.output_len,
                        group_id=f"r{i}" if params.n > 1 else None) for k in range(params.n)]
        request = seqs[0]
        request.pending_forks = seqs[1:]
        core.add_request(request)

    step_s, take_s, pickle_s, batch = [], [], [], []
    for _ in range(args.max_steps):
        if not core.has_unfinished_requests():
            break
        t0 = time.perf_counter()
        core.step()
        t1 = time.perf_counter()
        snapshot = take_kv_snapshot(scheduler)
        t2 = time.perf_counter()
        pickle.dumps(("utility", ("kv_snapshot", snapshot)), protocol=5)
        t3 = time.perf_counter()
        step_s.append(t1 - t0)
        take_s.append(t2 - t1)
        pickle_s.append(t3 - t2)
        batch.append(snapshot.num_running)
    full = [i for i, b in enumerate(batch) if b >= max(batch) * 0.9]  # steps at full load
    step = statistics.mean(step_s[i] for i in full)
    cost = statistics.mean(take_s[i] + pickle_s[i] for i in full)
    print(f"{len(built.scheduler.kv_cache_manager.block_pool.blocks)} blocks, {len(step_s)} steps, "
          f"{len(full)} at full load (running {min(batch[i] for i in full)}-{max(batch)})")
    print(f"step: mean {1e3 * step:.1f} ms, median {1e3 * statistics.median(step_s[i] for i in full):.1f} ms")
    print(f"snapshot: build mean {1e6 * statistics.mean(take_s[i] for i in full):.0f} us, "
          f"pickle mean {1e6 * statistics.mean(pickle_s[i] for i in full):.0f} us, "
          f"max {1e6 * max(take_s[i] + pickle_s[i] for i in full):.0f} us")
    print(f"snapshot / step: {100 * cost / step:.3f}%")
