"""`pagedllm bench serve` against the test server (tiny workload), and its summary maths."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from pagedllm.benchmarks.serve import RequestResult, format_summary, run_benchmark, summarize


def test_summary_maths():
    results = [
        RequestResult(prompt_len=10, success=True, output_tokens=3, ttft=0.1, latency=0.5, itl=[0.2, 0.2]),
        RequestResult(prompt_len=20, success=True, output_tokens=5, ttft=0.3, latency=1.1, itl=[0.2] * 4),
        RequestResult(prompt_len=5, success=False, error="HTTP 500"),
    ]
    s = summarize(results, duration=2.0)
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 8
    assert s["output_throughput"] == 4.0 and s["request_throughput"] == 1.0
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(200.0)  # (0.5-0.1)/2 and (1.1-0.3)/4
    assert s["itl_ms"]["median"] == pytest.approx(200.0)
    text = format_summary(s)
    assert "Mean TTFT (ms):" in text and "P99 E2EL (ms):" in text and "Output token throughput" in text


@pytest.mark.slow
def test_bench_serve_against_server(server, tmp_path):
    args = argparse.Namespace(
        base_url=server.url, endpoint="/v1/completions", model=None, api_key=None, num_prompts=4,
        random_input_len=24, random_output_len=5, random_range_ratio=0.0, vocab_size=32000,
        request_rate=float("inf"), max_concurrency=2, no_ignore_eos=False, seed=0,
        save_result=True, save_detailed=False, result_filename=str(tmp_path / "r.json"),
    )
    s = asyncio.run(run_benchmark(args))
    assert s["completed"] == 4 and s["failed"] == 0, s["errors"]
    assert s["total_input_tokens"] == 4 * 24
    assert s["total_output_tokens"] == 4 * 5  # ignore_eos: every request runs to length
    assert s["ignore_eos"] is True and s["ttft_ms"]["mean"] > 0 and s["itl_ms"]["mean"] > 0
    json.dumps(s)
