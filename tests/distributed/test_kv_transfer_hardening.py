"""The KV-transfer ports against hostile peers and clients (issue 48, item 1), over real
loopback sockets: the producer's server thread and the consumer's loader thread outlive any
message and any connect error; a consumer refuses oversized answers; client-sent
kv_transfer_params are checked for form and trust (allowlist, HMAC signature)."""

from __future__ import annotations

import json
import time

import pytest
import torch
import zmq

from pagedllm.distributed.kv_transfer.base import KVConnectorMetadata, LoadSpec, ReleaseSpec, SendSpec
from pagedllm.distributed.kv_transfer.config import KVTransferConfig
from pagedllm.distributed.kv_transfer.zmq_connector import validate_kv_transfer_params
from pagedllm.distributed.kv_transfer.zmq_worker import ZmqConnectorWorker
from pagedllm.kv_backends.paged.kv_cache_utils import hash_request_tokens
from tests.distributed.test_kv_transfer import BLOCK_SIZE, make_caches, wait_output
from tests.entrypoints.utils import free_port

GOOD = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 14579,
        "remote_transfer_id": "req-1-abc", "remote_num_blocks": 2}


@pytest.fixture
def pair():
    port = free_port()
    producer = ZmqConnectorWorker(KVTransferConfig(kv_role="kv_producer", kv_port=port), make_caches(torch.float32, 0))
    consumer = ZmqConnectorWorker(KVTransferConfig(kv_role="kv_consumer", kv_port=port, kv_transfer_timeout_s=2.0),
                                  make_caches(torch.float32, None))
    yield producer, consumer, port
    producer.shutdown()
    consumer.shutdown()


def pull_works(producer: ZmqConnectorWorker, consumer: ZmqConnectorWorker, port: int, tag: str) -> None:
    hashes = hash_request_tokens(list(range(2 * BLOCK_SIZE)), BLOCK_SIZE)
    producer.start_load_kv(KVConnectorMetadata(sends=[SendSpec(f"t-{tag}", hashes, [3, 4])]))
    consumer.start_load_kv(KVConnectorMetadata(loads=[LoadSpec(f"r-{tag}", f"t-{tag}", "127.0.0.1", port, hashes,
                                                                [7, 8])]))
    wait_output(consumer, timeout_s=10, finished_recving={f"r-{tag}"})
    for src, dst in zip(producer.kv_caches, consumer.kv_caches):
        assert torch.equal(src[:, [3, 4]], dst[:, [7, 8]])


def test_producer_survives_malformed_messages(pair):
    producer, consumer, port = pair
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    for msg in ([b"pull", b"[]"], [b"pull", json.dumps({"transfer_id": "t", "hashes": [1]}).encode()],
                [b"pull", b"\xff not json"], [b"pull"], [b"bogus", b"{}"], [b"release", b"null"],
                [b"pull", json.dumps({"transfer_id": 5, "hashes": []}).encode()],
                [b"pull", json.dumps({"transfer_id": "t", "hashes": ["zz"]}).encode()]):
        sock.send_multipart(msg)
    time.sleep(0.5)
    sock.close()
    ctx.term()
    pull_works(producer, consumer, port, "after")  # before the fix: the server thread was dead
    assert producer.get_stats()["dead_threads"] == 0


def test_loader_survives_bad_addresses(pair):
    producer, consumer, port = pair
    hashes = hash_request_tokens(list(range(BLOCK_SIZE)), BLOCK_SIZE)
    # A release to port -1 made zmq's connect raise on the loader thread, which died.
    consumer.start_load_kv(KVConnectorMetadata(
        releases=[ReleaseSpec("t-x", "127.0.0.1", -1), ReleaseSpec("t-y", "not a host", 5)],
        loads=[LoadSpec("r-bad", "t-z", "127.0.0.1", -1, hashes, [1])],
    ))
    failed = wait_output(consumer, failed_recving={"r-bad": ""})["failed_recving"]
    assert failed["r-bad"]
    pull_works(producer, consumer, port, "after")
    assert consumer.get_stats()["dead_threads"] == 0


def test_dead_loader_is_counted(pair, monkeypatch):
    _, consumer, _ = pair

    def die(job):
        raise SystemExit("boom")  # not an Exception: gets past the thread's guard

    monkeypatch.setattr(consumer, "_load_one", die)
    consumer.start_load_kv(KVConnectorMetadata(releases=[ReleaseSpec("t", "127.0.0.1", 1)]))
    deadline = time.monotonic() + 5
    while consumer.get_stats()["dead_threads"] == 0:
        assert time.monotonic() < deadline, "the dead loader thread is not reported"
        time.sleep(0.05)
    assert consumer.get_stats()["dead_threads"] == 1


class FakeProducer:
    """A ROUTER on loopback that answers every pull with ``frames`` after a header that
    claims our geometry."""

    def __init__(self, consumer: ZmqConnectorWorker, runs: list, frame_bytes: list[int]) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.header = {"ok": True, "transfer_id": "t", "runs": runs, "block_size": consumer.block_size,
                       "num_kv_heads": consumer.num_kv_heads, "head_dim": consumer.head_dim,
                       "num_layers": len(consumer.kv_caches), "dtype": str(consumer.dtype),
                       "kv_cache_dtype": consumer.kv_cache_dtype}
        self.frame_bytes = frame_bytes

    def answer_one(self) -> None:
        assert self.sock.poll(5000), "no pull arrived"
        identity, *_ = self.sock.recv_multipart()
        frames = [identity, json.dumps(self.header).encode()]
        frames += [b"\x7f" * n for n in self.frame_bytes]
        self.sock.send_multipart(frames)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.mark.parametrize("case", ["one_huge_frame", "frames_too_big", "runs_beyond_request"])
def test_consumer_refuses_oversized_answers(case):
    consumer = ZmqConnectorWorker(KVTransferConfig(kv_role="kv_consumer", kv_transfer_timeout_s=1.5),
                                  make_caches(torch.float32, None))
    per_block = consumer.block_bytes
    layers = len(consumer.kv_caches)
    runs, frame_bytes = {
        # 64 MiB in one frame, for a pull of one block: zmq drops it unbuffered.
        "one_huge_frame": ([[0, 1]], [64 << 20] + [per_block] * (2 * layers - 1)),
        # Frames twice the size a one-block run implies.
        "frames_too_big": ([[0, 1]], [2 * per_block] * (2 * layers)),
        # Runs that claim more blocks than were asked for.
        "runs_beyond_request": ([[0, 2]], [2 * per_block] * (2 * layers)),
    }[case]
    fake = FakeProducer(consumer, runs, frame_bytes)
    try:
        hashes = hash_request_tokens(list(range(BLOCK_SIZE)), BLOCK_SIZE)
        consumer.start_load_kv(KVConnectorMetadata(loads=[LoadSpec("r", "t", "127.0.0.1", fake.port, hashes, [5])]))
        fake.answer_one()
        failed = wait_output(consumer, failed_recving={"r": ""})["failed_recving"]
        expect = "no answer" if case == "one_huge_frame" else "malformed answer"
        assert expect in failed["r"], failed
        assert not any(c.any() for c in consumer.kv_caches)
        assert consumer.get_stats()["dead_threads"] == 0
    finally:
        fake.close()
        consumer.shutdown()


def test_pull_gives_up_at_its_deadline():
    """A producer that never answers holds a pull only until the request's deadline, not
    kv_transfer_timeout_s."""
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    consumer = ZmqConnectorWorker(KVTransferConfig(kv_role="kv_consumer", kv_transfer_timeout_s=60),
                                  make_caches(torch.float32, None))
    try:
        hashes = hash_request_tokens(list(range(BLOCK_SIZE)), BLOCK_SIZE)
        t0 = time.monotonic()
        consumer.start_load_kv(KVConnectorMetadata(loads=[
            LoadSpec("r1", "t1", "127.0.0.1", port, hashes, [1], deadline=t0 + 0.5),
            LoadSpec("r2", "t2", "127.0.0.2", port, hashes, [2], deadline=t0 + 0.2),  # expired in the queue
        ]))
        failed = wait_output(consumer, timeout_s=5, failed_recving={"r1": "", "r2": ""})["failed_recving"]
        assert time.monotonic() - t0 < 2.0
        assert "no answer" in failed["r1"] and "before its pull started" in failed["r2"]
    finally:
        consumer.shutdown()
        silent.close()
        ctx.term()


# ---- client-sent kv_transfer_params ----------------------------------------------------------

@pytest.mark.parametrize("change, text", [
    ({"remote_port": -1}, "remote_port"), ({"remote_port": 0}, "remote_port"),
    ({"remote_port": 65536}, "remote_port"), ({"remote_port": "14579"}, "remote_port"),
    ({"remote_port": True}, "remote_port"), ({"remote_host": "http://evil/"}, "remote_host"),
    ({"remote_host": "a b"}, "remote_host"), ({"remote_host": 5}, "remote_host"),
    ({"remote_host": "x" * 300}, "remote_host"), ({"remote_num_blocks": -1}, "remote_num_blocks"),
    ({"remote_num_blocks": "2"}, "remote_num_blocks"), ({"remote_transfer_id": ["t"]}, "remote_transfer_id"),
    ({"remote_transfer_id": "t\n"}, "remote_transfer_id"), ({"do_remote_decode": "yes"}, "do_remote_decode"),
])
def test_malformed_params_are_refused(change, text):
    with pytest.raises(ValueError, match=text):
        validate_kv_transfer_params({**GOOD, **change})


def test_default_trust_is_loopback():
    config = KVTransferConfig(kv_role="kv_consumer")
    validate_kv_transfer_params(GOOD, config)
    validate_kv_transfer_params({**GOOD, "remote_host": "localhost"}, config)
    for host in ("10.0.0.7", "169.254.169.254", "example.com"):
        with pytest.raises(ValueError, match="not a trusted prefill instance"):
            validate_kv_transfer_params({**GOOD, "remote_host": host}, config)


def test_trusted_producers_allowlist():
    config = KVTransferConfig(kv_role="kv_consumer", kv_connector_extra_config={
        "trusted_producers": ["10.0.0.7:14579", "prefill-2.internal"]})
    validate_kv_transfer_params({**GOOD, "remote_host": "10.0.0.7"}, config)
    validate_kv_transfer_params({**GOOD, "remote_host": "prefill-2.internal", "remote_port": 9}, config)
    for change in ({"remote_host": "10.0.0.7", "remote_port": 22}, {"remote_host": "127.0.0.1"},
                   {"remote_host": "10.0.0.8"}):
        with pytest.raises(ValueError, match="not a trusted"):
            validate_kv_transfer_params({**GOOD, **change}, config)
    with pytest.raises(ValueError, match="trusted_producers"):
        KVTransferConfig(kv_role="kv_consumer", kv_connector_extra_config={"trusted_producers": ["a:b:c:99999"]})
    with pytest.raises(ValueError, match="unknown keys"):
        KVTransferConfig(kv_role="kv_consumer", kv_connector_extra_config={"trusted_producer": []})


def test_signed_params_from_the_producer():
    from pagedllm.distributed.kv_transfer.zmq_connector import ZmqConnectorScheduler
    from tests.core.utils import make_request

    secret = {"shared_secret": "s3cret-s3cret-s3cret"}
    producer = ZmqConnectorScheduler(KVTransferConfig(kv_role="kv_producer", kv_host="10.0.0.7",
                                                      kv_connector_extra_config=secret), 4)
    request = make_request("p", list(range(8)), max_tokens=1)
    request.kv_transfer_params = {"do_remote_decode": True}
    _, params = producer.request_finished(request, [1, 2], [b"a" * 32, b"b" * 32])
    assert params["remote_signature"]
    consumer = KVTransferConfig(kv_role="kv_consumer", kv_connector_extra_config=secret)
    validate_kv_transfer_params(params, consumer)  # not loopback, but signed
    for change in ({"remote_host": "10.6.6.6"}, {"remote_num_blocks": 1}, {"remote_signature": "00" * 32},
                   {"remote_signature": None}):
        with pytest.raises(ValueError, match="remote_signature"):
            validate_kv_transfer_params({**params, **change}, consumer)
    other = KVTransferConfig(kv_role="kv_consumer", kv_connector_extra_config={"shared_secret": "x" * 16})
    with pytest.raises(ValueError, match="remote_signature"):
        validate_kv_transfer_params(params, other)


# ---- a real decode server ----------------------------------------------------------------------

SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", "16MiB",
               "--max-num-seqs", "4"]
KILL_LOADER = "kill-loader"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # three full blocks to pull


@pytest.fixture(scope="module")
def decode_server(tiny_llama_dir):
    from tests.entrypoints.utils import RemoteServer

    config = {"kv_role": "kv_consumer", "kv_transfer_timeout_s": 30, "kv_remote_wait_timeout_s": 1.5}
    server = RemoteServer(SERVER_ARGS + ["--kv-transfer-config", json.dumps(config)], model=tiny_llama_dir,
                          env={"PAGEDLLM_INJECT_FAULT": f"kv_loader:{KILL_LOADER}"}, startup_timeout_s=900)
    yield server
    server.stop()


def post(server, params: dict, **extra):
    import httpx

    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0.0, "kv_transfer_params": params, **extra}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120)


@pytest.mark.slow
def test_server_refuses_bad_and_untrusted_params_with_a_400(decode_server):
    for change, text in [({"remote_port": -1}, "remote_port"), ({"remote_port": "1"}, "remote_port"),
                         ({"remote_host": "evil host"}, "remote_host"),
                         ({"remote_host": "169.254.169.254"}, "not a trusted prefill instance")]:
        r = post(decode_server, {**GOOD, **change})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert text in error["message"] and error["code"] == 400 and error["type"], error


@pytest.mark.slow
def test_server_remote_wait_deadline_then_dead_loader_on_health(decode_server):
    """A producer that accepts the pull and never answers: the request fails after
    kv_remote_wait_timeout_s (not kv_transfer_timeout_s = 30 s) and every block comes back.
    Then a loader thread killed by an injected fault turns /health to 503."""
    import httpx

    from tests.distributed.test_disagg_e2e import wait_blocks_free

    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        t0 = time.monotonic()
        r = post(decode_server, {**GOOD, "remote_port": port, "remote_num_blocks": 3})
        assert r.status_code == 503, r.text
        assert "did not arrive" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 10
        wait_blocks_free(decode_server, timeout_s=10)
        assert httpx.get(decode_server.url + "/health").status_code == 200
        # The loader thread dies taking this request's pull off its queue.
        r = post(decode_server, {**GOOD, "remote_port": port, "remote_num_blocks": 3},
                 request_id=f"{KILL_LOADER}-1")
        assert r.status_code == 503, r.text
        deadline = time.monotonic() + 10
        while httpx.get(decode_server.url + "/health").status_code != 503:
            assert time.monotonic() < deadline, "/health did not report the dead loader thread"
            time.sleep(0.2)
    finally:
        silent.close()
        ctx.term()
