"""The engine-core process never outlives the server, even one killed with SIGKILL."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from tests.entrypoints.utils import RemoteServer, child_pids, pid_alive

pytestmark = pytest.mark.slow


def test_core_dies_with_killed_server(tiny_llama_dir):
    srv = RemoteServer(["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", "16MiB"],
                       model=tiny_llama_dir)
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200, r.text
        children = child_pids(srv.proc.pid)
        assert children
        srv.proc.send_signal(signal.SIGKILL)  # no chance to clean up
        srv.proc.wait(10)
        deadline = time.monotonic() + 10
        while any(pid_alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(pid_alive(c) for c in children), "the engine core outlived its server"
    finally:
        srv.stop()
