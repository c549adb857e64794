"""A producer's held blocks are never freed while a send of them may still read them.

Consumer A is a real consumer worker in its own process, stopped with SIGSTOP while the
producer's answer (far larger than loopback's socket buffers) is half sent. The producer must
keep A's transfer out of ``finished_sending`` (the scheduler frees a hold only on that) past
the old 1 s-class tracker wait, answer consumer B's pull meanwhile, and, A never resuming,
abort the send after ``kv_send_timeout_s`` and only then free the blocks. A, resumed at the
end, reports its pull failed (no partial KV lands). Killed instead of resumed, A's connection
is known dead at once and the blocks come back without waiting for the abort."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import torch

from pagedllm.kv_backends.paged.kv_cache_utils import hash_request_tokens
from pagedllm.distributed.kv_transfer.base import KVConnectorMetadata, LoadSpec, SendSpec
from pagedllm.distributed.kv_transfer.config import KVTransferConfig
from pagedllm.distributed.kv_transfer.zmq_worker import ZmqConnectorWorker
from tests.distributed.test_kv_transfer import wait_output
from tests.entrypoints.utils import REPO_ROOT, free_port

# One block is 2 (K, V) x 2 layers x 16 x 8 x 128 float32 = 256 KiB; the big transfer, 128 MiB,
# is several times what loopback's send and receive buffers take (tcp_wmem/tcp_rmem maxima).
NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, LAYERS = 520, 16, 8, 128, 2
BIG = list(range(512))
SMALL = [513, 514]
SEND_TIMEOUT_S = 6.0

CONSUMER = """
import json, sys, time, torch
from pagedllm.kv_backends.paged.kv_cache_utils import BlockHash
from pagedllm.distributed.kv_transfer.base import KVConnectorMetadata, LoadSpec
from pagedllm.distributed.kv_transfer.config import KVTransferConfig
from pagedllm.distributed.kv_transfer.zmq_worker import ZmqConnectorWorker
job = json.loads(sys.stdin.readline())
caches = [torch.zeros(job["shape"]) for _ in range(job["layers"])]
worker = ZmqConnectorWorker(KVTransferConfig(kv_role="kv_consumer", kv_transfer_timeout_s=5.0), caches)
hashes = [BlockHash(bytes.fromhex(h)) for h in job["hashes"]]
worker.start_load_kv(KVConnectorMetadata(loads=[
    LoadSpec("a", "big", "127.0.0.1", job["port"], hashes, list(range(len(hashes))))]))
time.sleep(0.5)  # the pull is on the wire (the producer keeps it until "big" is registered)
print("sent", flush=True)
while True:
    out = worker.get_finished()
    if out.finished_recving or out.failed_recving:
        print(json.dumps({"finished": sorted(out.finished_recving), "failed": out.failed_recving}), flush=True)
        break
    worker.wait_for_transfers(0.1)
worker.shutdown()
"""


def caches(fill: float) -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
    return [torch.full(shape, fill + layer) for layer in range(LAYERS)]


def start_stalled_pull(port: int, hashes: list) -> subprocess.Popen:
    """Consumer A in its own process, stopped (SIGSTOP) once its pull of "big" is on the wire;
    the producer has not registered "big" yet, so it answers only when the test does."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-c", CONSUMER], cwd=REPO_ROOT, env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    job = {"port": port, "shape": [2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM], "layers": LAYERS,
           "hashes": [bytes(h).hex() for h in (hashes[i] for i in BIG)]}
    child.stdin.write(json.dumps(job) + "\n")
    child.stdin.flush()
    assert child.stdout.readline().strip() == "sent"
    os.kill(child.pid, signal.SIGSTOP)
    return child


def end(child: subprocess.Popen) -> None:
    if child.poll() is None:
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait()


def make_producer(port: int) -> ZmqConnectorWorker:
    return ZmqConnectorWorker(KVTransferConfig(kv_role="kv_producer", kv_port=port, kv_hold_timeout_s=60,
                                               kv_send_timeout_s=SEND_TIMEOUT_S), caches(1.0))


def test_stalled_consumer_keeps_its_blocks_held_and_others_still_pull():
    port = free_port()
    hashes = hash_request_tokens(list(range(NUM_BLOCKS * BLOCK_SIZE)), BLOCK_SIZE)
    producer = make_producer(port)
    consumer_b = ZmqConnectorWorker(KVTransferConfig(kv_role="kv_consumer", kv_transfer_timeout_s=3.0), caches(0.0))
    child = start_stalled_pull(port, hashes)
    try:
        producer.start_load_kv(KVConnectorMetadata(sends=[
            SendSpec("big", [hashes[i] for i in BIG], BIG), SendSpec("small", [hashes[i] for i in SMALL], SMALL)]))
        t_sent = time.monotonic()

        freed: set[str] = set()
        deadline = t_sent + 2.0  # past a tracker wait of the old kind
        while time.monotonic() < deadline:
            freed |= producer.get_finished().finished_sending
            time.sleep(0.05)
        assert "big" not in freed, "blocks freed while the stopped consumer's answer was in flight"

        # B's pull is answered while A's send is stuck.
        consumer_b.start_load_kv(KVConnectorMetadata(loads=[
            LoadSpec("b", "small", "127.0.0.1", port, [hashes[i] for i in SMALL], [3, 4])]))
        wait_output(consumer_b, timeout_s=3.0, finished_recving={"b"})
        freed |= wait_output(producer, timeout_s=2.0, finished_sending={"small"})["finished_sending"]
        assert torch.equal(consumer_b.kv_caches[1][:, 3:5], producer.kv_caches[1][:, SMALL])
        assert "big" not in freed and time.monotonic() - t_sent < SEND_TIMEOUT_S

        # A never resumes: the send is aborted at its deadline, then the blocks come back.
        wait_output(producer, timeout_s=SEND_TIMEOUT_S + 10, finished_sending={"big"})
        assert time.monotonic() - t_sent >= SEND_TIMEOUT_S
        stats = producer.get_stats()
        assert stats["aborted_sends"] == 1 and stats["blocks_sent"] == len(SMALL), stats

        # A resumed: its pull fails (the partial answer was dropped), so it recomputes.
        os.kill(child.pid, signal.SIGCONT)
        result = json.loads(child.stdout.readline())
        assert result["finished"] == [] and "a" in result["failed"], result
        assert child.wait(30) == 0
    finally:
        end(child)
        producer.shutdown()
        consumer_b.shutdown()


def test_killed_consumer_frees_its_blocks_once_zmq_drops_the_answer():
    """A dead connection (kill -9 of the stopped consumer: its kernel resets the TCP
    connection) ends the send well before kv_send_timeout_s."""
    port = free_port()
    hashes = hash_request_tokens(list(range(NUM_BLOCKS * BLOCK_SIZE)), BLOCK_SIZE)
    producer = make_producer(port)
    child = start_stalled_pull(port, hashes)
    try:
        producer.start_load_kv(KVConnectorMetadata(sends=[SendSpec("big", [hashes[i] for i in BIG], BIG)]))
        time.sleep(1.0)
        assert "big" not in producer.get_finished().finished_sending
        t_kill = time.monotonic()
        child.kill()
        child.wait()
        wait_output(producer, timeout_s=SEND_TIMEOUT_S - 2, finished_sending={"big"})
        assert time.monotonic() - t_kill < SEND_TIMEOUT_S - 2 and producer.get_stats()["aborted_sends"] == 0
    finally:
        end(child)
        producer.shutdown()
