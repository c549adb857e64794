"""`pagedllm bench serve` against the test server, one tiny run per dataset kind and backend,
with vLLM's options; the result JSON's fields (the arithmetic: tests/benchmarks/test_serve_math.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedllm.benchmarks.serve import namespace, result_filename, run_benchmark

pytestmark = pytest.mark.slow

VLLM_FIELDS = {
    "date", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness",
    "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "max_output_tokens_per_s", "max_concurrent_requests",
}


def bench(server, **options) -> dict:
    args = namespace(**({"base_url": server.url, "num_prompts": 3, "max_concurrency": 2} | options))
    s = asyncio.run(run_benchmark(args))
    assert s["failed"] == 0, s["errors"]
    assert VLLM_FIELDS <= set(s), VLLM_FIELDS - set(s)
    json.dumps(s)
    return s


def test_random_completions_token_ids(server, tmp_path):
    s = bench(server, random_input_len=24, random_output_len=4, random_range_ratio=0.25, random_prefix_len=8,
              num_warmups=1, goodput=["ttft:60000", "tpot:60000"], metric_percentiles="50,90",
              percentile_metrics="ttft,tpot,itl,e2el", save_detailed=True)
    assert s["completed"] == 3 and s["ignore_eos"] is True  # vLLM's rule for random
    assert all(8 + 18 <= n <= 8 + 30 for n in s["input_lens"])  # the prefix, then 24 * (1 +- 0.25)
    assert s["total_input_tokens"] == sum(s["input_lens"])
    assert s["total_output_tokens"] == sum(s["output_lens"]) and all(3 <= n <= 5 for n in s["output_lens"])
    assert s["request_goodput"] == pytest.approx(s["request_throughput"])  # generous objectives
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert {f"mean_{metric}_ms", f"median_{metric}_ms", f"std_{metric}_ms", f"p50_{metric}_ms",
                f"p90_{metric}_ms"} <= set(s), metric
        assert f"p99_{metric}_ms" not in s
    assert 0 < s["p50_ttft_ms"] <= s["p90_ttft_ms"] and s["mean_e2el_ms"] >= s["mean_ttft_ms"]
    assert all(len(itl) == n - 1 for itl, n in zip(s["itls"], s["output_lens"]))
    args = namespace(model="a/b", max_concurrency=2, label="pl")
    assert result_filename(args, s).startswith("pl-infqps-concurrency2-")


def test_random_chat_with_burstiness(server):
    s = bench(server, backend="openai-chat", random_input_len=12, random_output_len=3, request_rate=20.0,
              burstiness=0.5, goodput=["e2el:0.001"])
    assert s["completed"] == 3 and s["backend"] == "openai-chat" and s["tokenizer_id"] == "server"
    assert s["request_rate"] == 20.0 and s["burstiness"] == 0.5
    assert s["request_goodput"] == 0.0  # no request ends within a microsecond
    assert s["total_output_tokens"] == 9


def test_prefix_repetition(server):
    s = bench(server, dataset_name="prefix_repetition", num_prompts=4, prefix_repetition_prefix_len=16,
              prefix_repetition_suffix_len=4, prefix_repetition_num_prefixes=2, prefix_repetition_output_len=3,
              ignore_eos=True)
    assert s["completed"] == 4 and s["total_input_tokens"] == 4 * 20 and s["total_output_tokens"] == 12


def test_sharegpt_file(server, tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "What is the capital of France? Answer briefly."},
                           {"from": "gpt", "value": "The capital of France is Paris, a city on the Seine."}]},
        {"conversations": [{"from": "human", "value": "Name three colours of the rainbow, please."},
                           {"from": "gpt", "value": "Red, orange and yellow are three of its colours."}]},
    ]))
    s = bench(server, dataset_name="sharegpt", dataset_path=str(path), backend="openai-chat",
              sharegpt_output_len=3, ignore_eos=True)
    assert s["completed"] == 3 and s["num_prompts"] == 3  # two conversations, oversampled
    assert s["total_output_tokens"] == 9 and s["total_input_tokens"] > 3 * 8


def test_custom_jsonl_with_chat_template_from_the_command_line(server, tmp_path, capsys):
    from pagedllm.entrypoints.cli import main

    path = tmp_path / "custom.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in ["Say hello.", "Count to three.", "Name a fruit."]))
    out = tmp_path / "result.json"
    main(["bench", "serve", "--base-url", server.url, "--dataset-name", "custom", "--dataset-path", str(path),
          "--num-prompts", "3", "--custom-output-len", "3", "--ignore-eos", "--max-concurrency", "2",
          "--save-result", "--save-detailed", "--result-filename", str(out), "--metric-percentiles", "50,99",
          "--goodput", "ttft:60000"])
    printed = capsys.readouterr().out
    assert "Request goodput (req/s):" in printed and "P50 TTFT (ms):" in printed and "P99 E2EL (ms):" in printed
    s = json.loads(out.read_text())
    assert VLLM_FIELDS <= set(s) and s["failed"] == 0, s["errors"]
    # The completions backend sends the chat template around each prompt: longer than the text.
    assert s["completed"] == 3 and all(n > 10 for n in s["input_lens"])
    assert s["total_output_tokens"] == 9 and s["request_goodput"] == pytest.approx(s["request_throughput"])
