"""`pagedllm serve` start-up: the engine core is spawned before the front end's imports, so
its failures must still reach the front end; `pagedllm bench startup` times a real start."""

from __future__ import annotations

import pytest

from pagedllm.benchmarks.startup import PHASES, run_offline_once, run_once
from tests.entrypoints.utils import REPO_ROOT, RemoteServer

pytestmark = pytest.mark.slow


def test_engine_start_failure_reaches_the_front_end(tmp_path) -> None:
    # The core fails at once, possibly before the front end has bound its sockets: the
    # reason must still arrive, and the server exit with an error. (A model that cannot be
    # found stops the front end before the core spawns: test_launch_lines.py; a checkpoint
    # whose architecture is unknown is found only by the core's loader.)
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"], "model_type": "nosuch"}')
    with pytest.raises(RuntimeError, match="server exited with 1") as info:
        RemoteServer([], model=str(tmp_path), startup_timeout_s=120)
    assert "the engine core failed to start: ValueError: " in str(info.value)
    assert "nosuch" in str(info.value)


def test_bench_startup_times_a_real_server(tiny_llama_dir) -> None:
    args = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", "16MiB"]
    result = run_once(str(REPO_ROOT), str(tiny_llama_dir), args, timeout_s=120)
    assert 0 < result.healthy_s < result.first_token_s
    assert result.cpu_s > 0
    # Every phase was logged, in order, before the server answered healthy.
    times = [result.phases[name] for name, _ in PHASES]
    assert times == sorted(times)
    assert times[-1] <= result.healthy_s + 0.01  # log stamps have millisecond resolution


def test_bench_startup_offline_times_a_fresh_process(tiny_llama_dir) -> None:
    result = run_offline_once(str(REPO_ROOT), str(tiny_llama_dir), timeout_s=120)
    assert 0 < result.phases["imported"] < result.healthy_s < result.first_token_s
    assert 0 < result.cpu_s
