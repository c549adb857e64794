"""`bench gguf-matmul`: one tiny case in process and through a checkout's subprocess."""

from __future__ import annotations

import argparse
import os

import pytest

from pagedllm.benchmarks import gguf_matmul
from pagedllm.kernels.build import gguf_linear_ops

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gguf_matmul.add_arguments(parser)
    return parser.parse_args(["--types", "Q4_K", "--shapes", "256x8", "--m", "1,3", "--rounds", "2",
                              "--min-bytes", "0", "--cache-bytes", "4096", *extra])


@pytest.mark.skipif(gguf_linear_ops() is None, reason="the gguf_linear extension did not build")
def test_measure_times_every_case_against_a_copy() -> None:
    result = gguf_matmul.measure(_args())
    assert set(result["cases"]) == {"Q4_K 256x8 m1", "Q4_K 256x8 m3"}
    for case in result["cases"].values():
        assert len(case["s"]) == 2 and all(s > 0 for s in case["s"]) and case["bytes"] == 8 * 144
    assert len(result["copy_gbps"]) == 2 and min(result["copy_gbps"]) > 0


@pytest.mark.skipif(gguf_linear_ops() is None, reason="the gguf_linear extension did not build")
def test_paths_alternate_per_case() -> None:
    # "fast" exists on every build (int8 where compiled, else the build's choice)
    result = gguf_matmul.measure(_args("--m", "1", "--path", "fast,float"))
    assert set(result["cases"]) == {"Q4_K 256x8 m1 fast", "Q4_K 256x8 m1 float"}


@pytest.mark.skipif(gguf_linear_ops() is None, reason="the gguf_linear extension did not build")
def test_checkouts_run_in_their_own_processes(capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr("sys.argv", ["pagedllm", "bench", "gguf-matmul", "--types", "Q4_K", "--shapes", "256x8",
                                     "--m", "1", "--rounds", "1", "--min-bytes", "0", "--cache-bytes", "0",
                                     "--checkout", ROOT])
    gguf_matmul.run(_args("--rounds", "1", "--checkout", ROOT))
    out = capsys.readouterr().out
    assert out.startswith(f"{ROOT}: threads") and "| Q4_K 256x8 m1 |" in out
