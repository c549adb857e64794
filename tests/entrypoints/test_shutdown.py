"""SIGTERM stops the server and its engine-core process cleanly, with a request in flight.

It stops the shared keyed server of conftest.py: this file sorts after the others using it
(test_auth.py, test_dashboard.py); run in another order, the fixture starts it again."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.entrypoints.conftest import API_KEY as KEY
from tests.entrypoints.conftest import SERVED_NAME as NAME
from tests.entrypoints.utils import SMALL_SERVER_ARGS, RemoteServer, child_pids, pid_alive

pytestmark = pytest.mark.slow


def test_sigterm_shuts_down_cleanly(keyed_server):
    """It stops the shared keyed server (last of its users)."""
    pid = keyed_server.proc.pid
    children = child_pids(pid)
    assert children, "the engine core should run in a child process"
    result: dict = {}

    def in_flight():
        try:
            r = httpx.post(keyed_server.url + "/v1/completions", timeout=60,
                           headers={"Authorization": f"Bearer {KEY}"},
                           json={"model": NAME, "prompt": "Once upon a time", "max_tokens": 8,
                                 "ignore_eos": True})
            result["status"] = r.status_code
            result["body"] = r.json()
        except httpx.HTTPError as e:
            result["error"] = e

    t = threading.Thread(target=in_flight)
    t.start()
    time.sleep(0.3)
    keyed_server.proc.send_signal(signal.SIGTERM)
    code = keyed_server.proc.wait(60)
    t.join(60)
    # A handled SIGTERM is a clean stop: exit 0 (not death by the re-raised signal).
    assert code == 0, keyed_server.log()
    assert "engine core process stopped (exit code 0)" in keyed_server.log()
    # The in-flight request either finished or failed with an error, never hung.
    assert result, "the in-flight request neither finished nor failed"
    if result.get("status") == 200:
        assert result["body"]["usage"]["completion_tokens"] == 8
    deadline = time.monotonic() + 10
    while any(pid_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(c) for c in children), "orphaned child processes"


DRAIN_S = 8.0


def _stream(url: str, max_tokens: int, out: dict, first: threading.Event) -> None:
    """A streamed completion: the events it got, and whether [DONE] came."""
    out["events"] = []
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=120,
                          json={"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time",
                                "max_tokens": max_tokens, "ignore_eos": True, "stream": True}) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    out["events"].append(json.loads(line[6:]))
                    first.set()
    except httpx.HTTPError as e:
        out["error"] = repr(e)
    first.set()


def test_sigterm_drains_then_aborts_within_the_bound():
    """--shutdown-timeout: after SIGTERM a new request gets a 503, a stream that ends within
    the window finishes, one longer than it is aborted with an error event, every KV block is
    let go, and the process exits 0 within the window plus uvicorn's close."""
    srv = RemoteServer([*SMALL_SERVER_ARGS, "--shutdown-timeout", str(DRAIN_S)])
    try:
        short, long_ = {}, {}
        short_first, long_first = threading.Event(), threading.Event()
        threads = [threading.Thread(target=_stream, args=(srv.url, 12, short, short_first)),
                   threading.Thread(target=_stream, args=(srv.url, 1900, long_, long_first))]
        for t in threads:
            t.start()
        assert short_first.wait(60) and long_first.wait(60), srv.log()
        sent = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        # Draining: the port still answers, but not with work.
        r = httpx.post(srv.url + "/v1/completions", timeout=30,
                       json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert "shutting down" in r.json()["error"]["message"]
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 503
        code = srv.proc.wait(DRAIN_S + 20)
        took = time.monotonic() - sent
        for t in threads:
            t.join(30)
        log = srv.log()
        assert code == 0, log
        assert took < DRAIN_S + 8, (took, log)
        # The short stream finished in the window, in full.
        assert short.get("done"), (short, log)
        assert short["events"][-1]["choices"][0]["finish_reason"] == "length"
        # The long one was aborted: its last event an error naming the flag (then [DONE], as
        # vLLM ends a stream that failed), no finish_reason.
        assert "error" in long_["events"][-1], long_["events"][-3:]
        assert "--shutdown-timeout" in long_["events"][-1]["error"]["message"]
        assert not any(c.get("finish_reason") for e in long_["events"] for c in e.get("choices", ()))
        assert "1 finished within" in log and "1 aborted" in log, log
        assert "0 running, 0 waiting, 0 KV block(s) in use" in log, log
    finally:
        srv.stop()
