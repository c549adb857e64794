"""Backpressure through a real server (issue 48): a streaming client that stops reading (a
small receive buffer, so the server's writes block) has its request paused after
--stalled-stream-timeout: the engine's running batch no longer holds it while other streams
go on; reading again resumes it with the output of an unpaused run (greedy); a stream paused
past --stalled-stream-abort-timeout is aborted and every KV block freed."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.entrypoints.utils import RemoteServer, metric_value

pytestmark = pytest.mark.slow

ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory-bytes", "32MiB",
        "--max-num-seqs", "16", "--stalled-stream-timeout", "0.5", "--stalled-stream-abort-timeout", "10"]
# ~8 KB per step (8 sequences, 20 top logprobs each): far more than loopback's socket buffers
# (the server's send buffer grows to tcp_wmem's 4 MiB) hold.
BODY = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 900, "temperature": 0,
        "ignore_eos": True, "logprobs": 20, "n": 8}


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_dir):
    srv = RemoteServer([*ARGS, "--served-model-name", "tiny"], model=tiny_llama_dir)
    yield srv
    srv.stop()


class StalledReader:
    """A streaming completion over a socket with a 4 KiB receive buffer, read on demand."""

    def __init__(self, url: str, body: dict) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect((host, int(port)))
        payload = json.dumps({**body, "stream": True}).encode()
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        self.data = b""

    def read_until(self, marker: bytes, timeout_s: float = 120.0) -> None:
        self.sock.settimeout(timeout_s)
        while marker not in self.data:
            chunk = self.sock.recv(65536)
            assert chunk, "the server closed the connection"
            self.data += chunk

    def events(self) -> list[dict]:
        head, _, body = self.data.partition(b"\r\n\r\n")
        assert b" 200 " in head.split(b"\r\n")[0], head
        text, pos = b"", 0
        while pos < len(body):  # chunked transfer encoding
            end = body.index(b"\r\n", pos)
            size = int(body[pos:end], 16)
            if size == 0:
                break
            text += body[end + 2:end + 2 + size]
            pos = end + 4 + size
        return [json.loads(line[6:]) for line in text.decode().splitlines()
                if line.startswith("data: {")]

    def close(self) -> None:
        self.sock.close()


def _metric(url: str, name: str) -> float:
    return metric_value(httpx.get(url + "/metrics").text, name)


def _wait_metric(url: str, name: str, ok, timeout_s: float = 60.0) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        value = _metric(url, name)
        if ok(value):
            return value
        assert time.monotonic() < deadline, f"{name} = {value}"
        time.sleep(0.1)


def _wait_paused(url: str) -> None:
    """Until the engine's batch has run the stalled request and then let it go (the gauge is
    the core's latest stats: wait for it to count the request first, not a stale 0)."""
    _wait_metric(url, "pagedllm:num_requests_running", lambda v: v > 0)
    _wait_metric(url, "pagedllm:num_requests_running", lambda v: v == 0)
    assert _metric(url, "pagedllm:num_requests_paused") == 8  # n=8: every sequence
    tokens = _metric(url, "pagedllm:generation_tokens_total")
    time.sleep(1.0)
    assert _metric(url, "pagedllm:generation_tokens_total") == tokens, "a paused request kept generating"


def _texts(events: list[dict]) -> list[str]:
    """Each choice's text, by index, from the stream's chunks."""
    texts: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    return [texts[i] for i in sorted(texts)]


def test_stalled_reader_is_paused_and_resumed_with_identical_output(tiny_server):
    url = tiny_server.url
    reference = [c["text"] for c in httpx.post(url + "/v1/completions", json=BODY, timeout=120).json()["choices"]]
    reader = StalledReader(url, BODY)
    try:
        reader.read_until(b"data: {")  # one chunk, then no more reads
        # The server's writes block, the output waits unread: the request leaves the batch.
        _wait_paused(url)
        assert _metric(url, "pagedllm:kv_cache_usage_perc") > 0  # its blocks are kept
        # Another stream runs to its end meanwhile, alone in the batch.
        other = httpx.post(url + "/v1/completions", json={**BODY, "max_tokens": 64, "logprobs": None, "n": 1},
                           timeout=60).json()
        assert other["usage"]["completion_tokens"] == 64
        assert _metric(url, "pagedllm:num_requests_running") == 0
        reader.read_until(b"\r\n0\r\n\r\n")  # reading again resumes it: to the last chunk
    finally:
        reader.close()
    events = reader.events()
    assert sum(c.get("finish_reason") == "length" for e in events for c in e["choices"]) == 8
    assert _texts(events) == reference
    _wait_metric(url, "pagedllm:kv_cache_usage_perc", lambda v: v == 0, 10)


def test_reader_stalled_past_the_abort_limit_frees_every_block(tiny_server):
    url = tiny_server.url
    reader = StalledReader(url, BODY)
    try:
        reader.read_until(b"data: {")
        _wait_paused(url)
        assert _metric(url, "pagedllm:kv_cache_usage_perc") > 0
        t0 = time.monotonic()
        _wait_metric(url, "pagedllm:kv_cache_usage_perc", lambda v: v == 0, 30)
        assert time.monotonic() - t0 > 4  # held while paused, freed at the abort limit (10 s)
        assert _metric(url, "pagedllm:num_requests_running") == _metric(url, "pagedllm:num_requests_paused") == 0
        reader.read_until(b"\r\n0\r\n\r\n", 30)  # the stream ends with an error event
    finally:
        reader.close()
    error = reader.events()[-1]["error"]
    assert "--stalled-stream-abort-timeout" in error["message"], error
