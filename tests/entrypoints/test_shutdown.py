"""SIGTERM stops the server and its engine-core process cleanly, with a request in flight.

It stops the shared keyed server of conftest.py: this file sorts after the others using it
(test_auth.py, test_dashboard.py); run in another order, the fixture starts it again."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.entrypoints.conftest import API_KEY as KEY
from tests.entrypoints.conftest import SERVED_NAME as NAME
from tests.entrypoints.utils import child_pids, pid_alive

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
