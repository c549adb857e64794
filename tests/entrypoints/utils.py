"""Run `pagedllm serve` as a subprocess on a free port for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
SMALL_SERVER_ARGS = [
    "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory-bytes", "256MiB",
    "--max-num-seqs", "16",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of pid, from /proc."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(entry))
    return children


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class RemoteServer:
    def __init__(self, extra_args: list[str], model: str | None = "SmolLM2-135M-Instruct",
                 env: dict[str, str] | None = None, startup_timeout_s: float = 240.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # float32 activations unless a test asks otherwise: tests compare by the float32 tie rule.
        pinned = [] if {"--matmul-activations", "--prefill-activations"} & set(extra_args) else [
            "--matmul-activations", "float32"]
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *([model] if model else []),
               "--port", str(self.port), *pinned, *extra_args]
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"pagedllm-server-{self.port}.log"
        self._log = open(self.log_path, "w")
        # Tests share the machine with other work: with more runnable threads than cores,
        # OpenMP's barriers stall (measured here: 0.12 s/token with 1 thread, 0.6-1.7 s with 2).
        base_env = {"OMP_NUM_THREADS": "1", **os.environ}
        self.proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT,
            env={**base_env, **(env or {})},
        )
        self._wait_healthy(startup_timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()[-5000:]

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The value of a Prometheus sample `name{...}` whose labels include `labels`."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        rest = line[len(name):]
        if rest and rest[0] not in "{ ":
            continue  # a longer metric name
        if labels and not all(f'{k}="{v}"' in rest for k, v in labels.items()):
            continue
        return float(line.rsplit(" ", 1)[1])
    return None


def engine_core_pid(server_pid: int) -> int:
    """The engine-core process among the server's children (not multiprocessing's helpers)."""
    cores = []
    for pid in child_pids(server_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                cores.append(pid)
    assert len(cores) == 1, cores
    return cores[0]
