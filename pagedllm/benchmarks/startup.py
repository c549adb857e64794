"""`pagedllm bench startup`: seconds from `pagedllm serve` to healthy and to the first token.

Spawns `python -m pagedllm.entrypoints.cli serve MODEL --port P ARGS...`, polls /health every
20 ms, then streams one completion and times its first chunk. It prints, per run, the wall
seconds to healthy and to the first token, the CPU seconds the server's processes (front end
and engine core) had used by then (a steadier figure than wall time on a shared machine), and
the phases read from the server's log (seconds since the spawn). With several `--checkout`
directories the runs alternate between them (PYTHONPATH set to each), so a before/after
comparison is measured side by side in one run.

Extra arguments after the options go to `pagedllm serve`, e.g.
`pagedllm bench startup -- --max-model-len 2048`. `--offline` times the other start instead:
`LLM(model)` and one generated token in a fresh interpreter (the engine built stands for
healthy; the phase is the end of `from pagedllm import LLM`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime

# Log messages marking the phases of a start-up: (phase name, pattern of the message).
PHASES = (
    ("core spawned", re.compile(r"started engine core process")),
    ("model loaded", re.compile(r"pagedllm\.models\.loader: loaded ")),
    ("KV cache allocated", re.compile(r"KV cache: .* Ready in")),
    ("warm-up done", re.compile(r"warm-up done")),
    ("front end ready", re.compile(r"engine ready: ")),
)
_LOG_TIME = re.compile(r"^\w+ (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


@dataclass
class StartupResult:
    checkout: str
    healthy_s: float
    first_token_s: float
    cpu_s: float
    """CPU seconds (user + system) of the server's process tree at the first token."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds from the spawn to each phase's log line."""

    def summary(self) -> str:
        phases = ", ".join(f"{name} {t:.2f}" for name, t in self.phases.items())
        return (
            f"{self.checkout}: healthy {self.healthy_s:.2f} s, first token {self.first_token_s:.2f} s, "
            f"server CPU {self.cpu_s:.2f} s  [{phases}]"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and all its live descendants (Linux /proc),
    including the children they have already reaped."""
    tick = os.sysconf("SC_CLK_TCK")
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            # fields[11:15]: utime, stime, cutime, cstime (stat fields 14-17)
            total += sum(int(x) for x in fields[11:15]) / tick
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue  # exited meanwhile
    return total


def _phases(log_text: str, spawn_time: float) -> dict[str, float]:
    phases: dict[str, float] = {}
    for line in log_text.splitlines():
        m = _LOG_TIME.match(line)
        if m is None:
            continue
        for name, pattern in PHASES:
            if name not in phases and pattern.search(line):
                stamp = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                phases[name] = stamp - spawn_time
    return phases


def run_once(checkout: str, model: str, serve_args: list[str], timeout_s: float) -> StartupResult:
    import httpx

    port = _free_port()
    env = dict(os.environ, PYTHONPATH=checkout)
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, "--port", str(port),
           "--uvicorn-log-level", "warning", *serve_args]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        # One clock for everything: the phases come from the log's wall-clock stamps, and a
        # wall clock that is stepped or slewed meanwhile (NTP on a VM) would misorder a phase
        # and the health check measured on another clock (seen once: a phase logged 30 ms
        # "after" the health answer it preceded).
        spawn_time = time.time()
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=checkout)
        try:
            with httpx.Client(timeout=5.0) as client:
                while True:
                    if proc.poll() is not None:
                        log.seek(0)
                        tail = log.read()[-3000:]
                        raise RuntimeError(f"the server exited with code {proc.returncode}:\n{tail}")
                    if time.time() - spawn_time > timeout_s:
                        raise RuntimeError(f"the server was not healthy within {timeout_s:.0f} s")
                    try:
                        if client.get(f"{url}/health").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    time.sleep(0.02)
                healthy_s = time.time() - spawn_time
                body = {"model": model, "prompt": "Hello, my name is", "max_tokens": 4, "stream": True}
                with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                    response.raise_for_status()
                    for line in response.iter_lines():
                        if line.startswith("data:"):
                            break
                first_token_s = time.time() - spawn_time
            cpu_s = _tree_cpu_seconds(proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.seek(0)
        phases = _phases(log.read(), spawn_time)
    return StartupResult(checkout, healthy_s, first_token_s, cpu_s, phases)


# The offline start: a fresh interpreter builds LLM(model) and generates one token from a
# short prompt, printing the wall-clock time at each step (the clock the parent reads).
_OFFLINE_CODE = """
import sys, time
from pagedllm import LLM, SamplingParams
print("imported", time.time(), flush=True)
llm = LLM(sys.argv[1])
print("LLM built", time.time(), flush=True)
llm.generate(["Hello, my name is"], SamplingParams(max_tokens=1), use_tqdm=False)
print("first token", time.time(), flush=True)
print("cpu", time.process_time(), flush=True)
"""


def run_offline_once(checkout: str, model: str, timeout_s: float) -> StartupResult:
    """`LLM(model)` and one generated token in a fresh process: healthy_s is the engine
    built, first_token_s the token back; cpu_s the process's CPU seconds by then."""
    env = dict(os.environ, PYTHONPATH=checkout)
    spawn_time = time.time()
    proc = subprocess.Popen([sys.executable, "-c", _OFFLINE_CODE, model], env=env, cwd=checkout,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"the offline start did not finish within {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"the offline start exited with code {proc.returncode}:\n{out[-3000:]}")
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
              for line in out.splitlines() if line.startswith(("imported ", "LLM built ", "first token ", "cpu "))}
    return StartupResult(checkout, values["LLM built"] - spawn_time, values["first token"] - spawn_time,
                         values["cpu"], {"imported": values["imported"] - spawn_time})


def run(args: argparse.Namespace) -> None:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per /health poll otherwise
    checkouts = args.checkout or [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    results: list[StartupResult] = []
    for _ in range(args.num_runs):
        for checkout in checkouts:
            if args.offline:
                result = run_offline_once(checkout, args.model, args.timeout)
            else:
                result = run_once(checkout, args.model, serve_args, args.timeout)
            print(result.summary(), flush=True)
            results.append(result)
    for checkout in checkouts:
        mine = [r for r in results if r.checkout == checkout]
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        print(
            f"median of {len(mine)} {checkout}: healthy {med([r.healthy_s for r in mine]):.2f} s, "
            f"first token {med([r.first_token_s for r in mine]):.2f} s, "
            f"server CPU {med([r.cpu_s for r in mine]):.2f} s"
        )
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--checkout", action="append", default=None,
                   help="a pagedllm checkout to run (repeatable; runs alternate); default: this one")
    p.add_argument("--num-runs", type=int, default=1, help="runs per checkout")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for /health")
    p.add_argument("--offline", action="store_true",
                   help="time `LLM(model)` and one token in a fresh process instead of a server "
                        "(healthy: the engine built)")
    p.add_argument("--save-json", default=None)
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="arguments for `pagedllm serve`")
