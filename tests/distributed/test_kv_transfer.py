"""The ZMQ KV transport between two connector worker sides over real loopback sockets:
blocks land byte-identical where asked, failures are reported, holds expire."""

from __future__ import annotations

import time

import pytest
import torch

from pagedllm.kv_backends.paged.kv_cache_utils import hash_request_tokens
from pagedllm.distributed.kv_transfer.base import KVConnectorMetadata, LoadSpec, ReleaseSpec, SendSpec
from pagedllm.distributed.kv_transfer.config import KVTransferConfig
from pagedllm.distributed.kv_transfer.zmq_worker import ZmqConnectorWorker, block_runs
from tests.entrypoints.utils import free_port

NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, LAYERS = 24, 4, 3, 8, 5


def make_caches(dtype: torch.dtype, seed: int | None) -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
    if seed is None:
        return [torch.zeros(shape, dtype=dtype) for _ in range(LAYERS)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(LAYERS)]


def wait_output(worker: ZmqConnectorWorker, timeout_s: float = 20.0, **expect):
    """Collect get_finished() until every expected id set/dict is reached."""
    seen = {"finished_sending": set(), "finished_recving": set(), "failed_recving": {}}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = worker.get_finished()
        seen["finished_sending"] |= out.finished_sending
        seen["finished_recving"] |= out.finished_recving
        seen["failed_recving"].update(out.failed_recving)
        if all(set(seen[k]) >= set(v) for k, v in expect.items()):
            return seen
        worker.wait_for_transfers(0.05)
    raise AssertionError(f"timed out: saw {seen}, expected {expect}")


@pytest.fixture
def pair(request):
    dtype = getattr(request, "param", torch.float32)
    port = free_port()
    producer = ZmqConnectorWorker(
        KVTransferConfig(kv_role="kv_producer", kv_port=port, kv_hold_timeout_s=1.5), make_caches(dtype, 0)
    )
    consumer = ZmqConnectorWorker(
        KVTransferConfig(kv_role="kv_consumer", kv_port=port, kv_transfer_timeout_s=1.0), make_caches(dtype, None)
    )
    yield producer, consumer, port
    producer.shutdown()
    consumer.shutdown()


def test_block_runs():
    assert block_runs([3, 4, 5, 9, 10, 2]) == [(0, 3), (3, 2), (5, 1)]
    assert block_runs([]) == []


@pytest.mark.parametrize("pair", [torch.float32, torch.bfloat16], indirect=True)
def test_blocks_land_byte_identical_under_their_hashes(pair):
    producer, consumer, port = pair
    hashes = hash_request_tokens(list(range(7 * BLOCK_SIZE)), BLOCK_SIZE)
    src_ids = [5, 6, 7, 12, 2, 3, 20]  # runs of consecutive and scattered ids
    producer.start_load_kv(KVConnectorMetadata(sends=[SendSpec("t1", hashes, src_ids)]))
    # The consumer asks for the last five blocks only (it has the first two locally).
    dst_ids = [1, 9, 10, 11, 17]
    consumer.start_load_kv(KVConnectorMetadata(loads=[LoadSpec("r1", "t1", "127.0.0.1", port, hashes[2:], dst_ids)]))
    wait_output(consumer, finished_recving={"r1"})
    wait_output(producer, finished_sending={"t1"})
    for src_cache, dst_cache in zip(producer.kv_caches, consumer.kv_caches):
        for s, d in zip(src_ids[2:], dst_ids):
            assert torch.equal(src_cache[:, s].view(torch.uint8), dst_cache[:, d].view(torch.uint8))
        untouched = [i for i in range(NUM_BLOCKS) if i not in dst_ids]
        assert not dst_cache[:, untouched].any()
    stats = consumer.get_stats()
    per_block = 2 * LAYERS * BLOCK_SIZE * HEADS * HEAD_DIM * producer.kv_caches[0].element_size()
    assert stats["blocks_received"] == 5 and stats["bytes_received"] == 5 * per_block
    assert producer.get_stats()["blocks_sent"] == 5
    # Pulled once: a second pull of the same transfer is refused (the blocks are released).
    consumer.start_load_kv(KVConnectorMetadata(loads=[LoadSpec("r2", "t1", "127.0.0.1", port, hashes[:1], [4])]))
    failed = wait_output(consumer, failed_recving={"r2": ""})["failed_recving"]
    assert "holds no blocks" in failed["r2"]


def test_pull_of_unheld_hashes_fails(pair):
    producer, consumer, port = pair
    hashes = hash_request_tokens(list(range(3 * BLOCK_SIZE)), BLOCK_SIZE)
    other = hash_request_tokens(list(range(1, 3 * BLOCK_SIZE + 1)), BLOCK_SIZE)
    producer.start_load_kv(KVConnectorMetadata(sends=[SendSpec("t1", hashes, [1, 2, 3])]))
    consumer.start_load_kv(KVConnectorMetadata(loads=[LoadSpec("r1", "t1", "127.0.0.1", port, other, [4, 5, 6])]))
    failed = wait_output(consumer, failed_recving={"r1": ""})["failed_recving"]
    assert "not held" in failed["r1"]
    assert not any(c[:, [4, 5, 6]].any() for c in consumer.kv_caches)


def test_producer_gone_times_out():
    consumer = ZmqConnectorWorker(
        KVTransferConfig(kv_role="kv_consumer", kv_transfer_timeout_s=0.5), make_caches(torch.float32, None)
    )
    try:
        hashes = hash_request_tokens(list(range(BLOCK_SIZE)), BLOCK_SIZE)
        port = free_port()
        t0 = time.monotonic()
        consumer.start_load_kv(KVConnectorMetadata(loads=[
            LoadSpec("r1", "t1", "127.0.0.1", port, hashes, [1]),
            LoadSpec("r2", "t2", "127.0.0.1", port, hashes, [2]),  # queued behind r1
        ]))
        failed = wait_output(consumer, failed_recving={"r1": "", "r2": ""})["failed_recving"]
        assert "no answer" in failed["r1"] and "moments ago" in failed["r2"]
        assert time.monotonic() - t0 < 1.0 + 0.5  # one timeout, not two
        assert consumer.get_stats()["failed_loads"] == 2
    finally:
        consumer.shutdown()


def test_release_and_expiry_free_holds(pair):
    producer, consumer, port = pair
    hashes = hash_request_tokens(list(range(2 * BLOCK_SIZE)), BLOCK_SIZE)
    producer.start_load_kv(KVConnectorMetadata(sends=[SendSpec("kept", hashes, [1, 2]),
                                                      SendSpec("released", hashes, [3, 4])]))
    consumer.start_load_kv(KVConnectorMetadata(releases=[ReleaseSpec("released", "127.0.0.1", port)]))
    t0 = time.monotonic()
    wait_output(producer, finished_sending={"released"})
    assert time.monotonic() - t0 < 1.5  # released on notice, before the hold timeout
    assert "kept" not in producer.get_finished().finished_sending
    wait_output(producer, finished_sending={"kept"})  # nobody pulled it: expired
    assert producer.get_stats()["expired_holds"] == 1


def test_malformed_message_does_not_stop_the_server(pair):
    import zmq

    producer, consumer, port = pair
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send_multipart([b"pull", b"not json"])
    sock.close()
    hashes = hash_request_tokens(list(range(BLOCK_SIZE)), BLOCK_SIZE)
    producer.start_load_kv(KVConnectorMetadata(sends=[SendSpec("t1", hashes, [3])]))
    consumer.start_load_kv(KVConnectorMetadata(loads=[LoadSpec("r1", "t1", "127.0.0.1", port, hashes, [5])]))
    wait_output(consumer, finished_recving={"r1"})
    assert torch.equal(producer.kv_caches[0][:, 3], consumer.kv_caches[0][:, 5])


def make_coded_caches(storage: str, seed: int | None) -> list[torch.Tensor]:
    """8-bit KV caches (layers/kv_quant.py): rows of HEAD_DIM codes and a float32 scale."""
    from pagedllm.layers.kv_quant import KV_QUANT_FORMATS, quantize_rows

    return [quantize_rows(c, KV_QUANT_FORMATS[storage]) for c in make_caches(torch.float32, seed)]


@pytest.mark.parametrize("storage", ["int8", "fp8_e4m3"])
def test_8bit_blocks_travel_with_their_scales(storage):
    port = free_port()
    producer = ZmqConnectorWorker(KVTransferConfig(kv_role="kv_producer", kv_port=port), make_coded_caches(storage, 0))
    consumer = ZmqConnectorWorker(KVTransferConfig(kv_role="kv_consumer", kv_port=port, kv_transfer_timeout_s=2.0),
                                  make_coded_caches(storage, None))
    try:
        assert consumer.head_dim == HEAD_DIM and consumer.kv_cache_dtype == storage
        hashes = hash_request_tokens(list(range(3 * BLOCK_SIZE)), BLOCK_SIZE)
        producer.start_load_kv(KVConnectorMetadata(sends=[SendSpec("t1", hashes, [4, 5, 9])]))
        consumer.start_load_kv(KVConnectorMetadata(loads=[LoadSpec("r1", "t1", "127.0.0.1", port, hashes, [1, 2, 3])]))
        wait_output(consumer, finished_recving={"r1"})
        for src, dst in zip(producer.kv_caches, consumer.kv_caches):
            assert torch.equal(src[:, [4, 5, 9]].view(torch.uint8), dst[:, [1, 2, 3]].view(torch.uint8))
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_int8_prefill_and_auto_decode_refuse_to_exchange():
    port = free_port()
    producer = ZmqConnectorWorker(KVTransferConfig(kv_role="kv_producer", kv_port=port), make_coded_caches("int8", 0))
    consumer = ZmqConnectorWorker(KVTransferConfig(kv_role="kv_consumer", kv_port=port, kv_transfer_timeout_s=2.0),
                                  make_caches(torch.float32, None))
    try:
        hashes = hash_request_tokens(list(range(BLOCK_SIZE)), BLOCK_SIZE)
        producer.start_load_kv(KVConnectorMetadata(sends=[SendSpec("t1", hashes, [4])]))
        consumer.start_load_kv(KVConnectorMetadata(loads=[LoadSpec("r1", "t1", "127.0.0.1", port, hashes, [1])]))
        failed = wait_output(consumer, failed_recving={"r1": ""})["failed_recving"]
        assert "kv_cache_dtype 'int8' (ours 'auto')" in failed["r1"] and "--kv-cache-dtype" in failed["r1"]
        assert not any(c.any() for c in consumer.kv_caches)  # nothing was written
    finally:
        producer.shutdown()
        consumer.shutdown()
