"""KV transfer throughput of the ZMQ connector between two processes over TCP loopback.

The producer process holds `--num-blocks` blocks of the default model's KV layout (30 layers,
3 KV heads x 64, 16-token blocks, float32: 0.7 MiB per block) and serves them; this process
pulls them `--repeat` times into its own pool through the same code the engine uses, and
reports MB/s per pull (request to blocks in place).

    pagedllm bench kv-transfer [--num-blocks 94] [--repeat 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16


def caches(num_blocks: int, fill: bool):
    import torch

    shape = (2, num_blocks + 1, BLOCK_SIZE, HEADS, HEAD_DIM)
    return [torch.randn(shape) if fill else torch.zeros(shape) for _ in range(LAYERS)]


def producer(port: int, num_blocks: int, repeat: int, ready, done) -> None:
    from pagedllm.kv_backends.paged.kv_cache_utils import hash_request_tokens
    from pagedllm.distributed.kv_transfer.base import KVConnectorMetadata, SendSpec
    from pagedllm.distributed.kv_transfer.config import KVTransferConfig
    from pagedllm.distributed.kv_transfer.zmq_worker import ZmqConnectorWorker

    worker = ZmqConnectorWorker(KVTransferConfig(kv_role="kv_producer", kv_port=port), caches(num_blocks, True))
    hashes = hash_request_tokens(list(range(num_blocks * BLOCK_SIZE)), BLOCK_SIZE)
    ids = list(range(1, num_blocks + 1))
    worker.start_load_kv(KVConnectorMetadata(sends=[SendSpec(f"t{i}", hashes, ids) for i in range(repeat)]))
    ready.set()
    done.wait(600)
    worker.shutdown()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-blocks", type=int, default=94, help="94 blocks = a 1,500-token prompt")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--port", type=int, default=14599)


def run(args: argparse.Namespace) -> None:
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=producer, args=(args.port, args.num_blocks, args.repeat, ready, done))
    proc.start()
    ready.wait(600)

    from pagedllm.kv_backends.paged.kv_cache_utils import hash_request_tokens
    from pagedllm.distributed.kv_transfer.base import KVConnectorMetadata, LoadSpec
    from pagedllm.distributed.kv_transfer.config import KVTransferConfig
    from pagedllm.distributed.kv_transfer.zmq_worker import ZmqConnectorWorker

    worker = ZmqConnectorWorker(KVTransferConfig(kv_role="kv_consumer"), caches(args.num_blocks, False))
    hashes = hash_request_tokens(list(range(args.num_blocks * BLOCK_SIZE)), BLOCK_SIZE)
    ids = list(range(1, args.num_blocks + 1))
    rates = []
    for i in range(args.repeat):
        t0 = time.perf_counter()
        worker.start_load_kv(KVConnectorMetadata(loads=[LoadSpec(f"r{i}", f"t{i}", "127.0.0.1", args.port, hashes, ids)]))
        while True:
            out = worker.get_finished()
            if out.failed_recving:
                raise RuntimeError(out.failed_recving)
            if out.finished_recving:
                break
            worker.wait_for_transfers(0.001)
        seconds = time.perf_counter() - t0
        num_bytes = worker.get_stats()["bytes_received"] / (i + 1)
        rates.append(num_bytes / 1e6 / seconds)
        print(f"pull {i}: {num_bytes / 1e6:.1f} MB in {seconds * 1e3:.0f} ms = {rates[-1]:.0f} MB/s")
    rates.sort()
    print(f"median {rates[len(rates) // 2]:.0f} MB/s over {args.repeat} pulls of {args.num_blocks} blocks")
    done.set()
    worker.shutdown()
    proc.join(30)
