"""`--metrics-names vllm`: every series a vLLM Grafana dashboard or autoscaler queries is on
/metrics under vLLM's name and labels, with values that add up to the requests sent."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.entrypoints.utils import RemoteServer, metric_value

pytestmark = pytest.mark.slow

MODEL = "tiny"
ARGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", "32MiB",
        "--served-model-name", MODEL, "--metrics-names", "vllm"]
LABELS = {"model_name": MODEL, "engine": "0"}
# What vLLM's example Grafana dashboard, its KEDA/HPA examples and common exporters query.
DASHBOARD_SERIES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:request_success_total", "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    *(f"vllm:{h}_{part}" for h in (
        "e2e_request_latency_seconds", "time_to_first_token_seconds", "time_per_output_token_seconds",
        "inter_token_latency_seconds", "request_time_per_output_token_seconds", "request_queue_time_seconds",
        "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
        "request_prompt_tokens", "request_generation_tokens", "request_max_num_generation_tokens",
        "request_params_n", "request_params_max_tokens", "iteration_tokens_total",
    ) for part in ("bucket", "sum", "count")),
]
PROMPTS = ["Tell me about the sea.", "Why is the sky blue?", "List three prime numbers:"]
MAX_TOKENS = [4, 5, 6]


@pytest.fixture(scope="module")
def vllm_names_server(tiny_llama_dir):
    srv = RemoteServer(ARGS, model=tiny_llama_dir)
    yield srv
    srv.stop()


def scrape(server) -> str:
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200
    return r.text


def value(text: str, name: str, **labels: str) -> float:
    v = metric_value(text, name, LABELS | labels)
    assert v is not None, f"{name} {labels} missing"
    return v


def test_vllm_names_and_values(vllm_names_server):
    usage = []
    with httpx.Client(base_url=vllm_names_server.base_url, timeout=120) as http:
        for prompt, max_tokens in zip(PROMPTS, MAX_TOKENS):
            r = http.post("/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            })
            assert r.status_code == 200, r.text
            usage.append(r.json()["usage"])
    prompt_sum = sum(u["prompt_tokens"] for u in usage)
    gen_sum = sum(u["completion_tokens"] for u in usage)
    assert gen_sum == sum(MAX_TOKENS)
    # Queue times and tokens per step come with the core's stats, sent once it goes idle.
    deadline = time.monotonic() + 30
    while True:
        text = scrape(vllm_names_server)
        if (metric_value(text, "vllm:request_queue_time_seconds_count", LABELS) == 3
                and metric_value(text, "vllm:num_requests_running", LABELS) == 0):
            break
        assert time.monotonic() < deadline, "the core's stats did not arrive"
        time.sleep(0.2)

    for name in DASHBOARD_SERIES:
        assert metric_value(text, name, LABELS) is not None, name
    assert "pagedllm:" not in text
    n = len(PROMPTS)
    assert value(text, "vllm:request_success_total", finished_reason="length") == n
    assert value(text, "vllm:prompt_tokens_total") == prompt_sum
    assert value(text, "vllm:generation_tokens_total") == gen_sum
    for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens", "request_time_per_output_token_seconds", "request_params_n"):
        assert value(text, f"vllm:{name}_count") == n, name
    assert value(text, "vllm:request_prompt_tokens_sum") == prompt_sum
    assert value(text, "vllm:request_generation_tokens_sum") == gen_sum
    assert value(text, "vllm:request_max_num_generation_tokens_sum") == gen_sum  # n = 1 each
    assert value(text, "vllm:request_params_max_tokens_sum") == sum(MAX_TOKENS)
    assert value(text, "vllm:request_params_n_sum") == n
    # One interval between consecutive output tokens (one token per step here).
    assert value(text, "vllm:inter_token_latency_seconds_count") == gen_sum - n
    assert value(text, "vllm:time_per_output_token_seconds_count") == gen_sum - n
    # Phases: prefill + decode = inference per request; each within the end-to-end latency.
    prefill, decode = value(text, "vllm:request_prefill_time_seconds_sum"), value(text, "vllm:request_decode_time_seconds_sum")
    inference, e2e = value(text, "vllm:request_inference_time_seconds_sum"), value(text, "vllm:e2e_request_latency_seconds_sum")
    queue = value(text, "vllm:request_queue_time_seconds_sum")
    assert prefill > 0 and decode > 0 and inference == pytest.approx(prefill + decode, rel=1e-6)
    assert queue + inference <= e2e
    # Tokens per step: each prompt's uncached tokens, then one per decode step.
    hits = value(text, "vllm:prefix_cache_hits_total")
    assert value(text, "vllm:iteration_tokens_total_sum") == prompt_sum - hits + gen_sum - n
    assert value(text, "vllm:num_requests_running") == 0 and value(text, "vllm:num_requests_waiting") == 0
    assert value(text, "vllm:kv_cache_usage_perc") == value(text, "vllm:gpu_cache_usage_perc") == 0.0
    info = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and info[0].endswith(" 1.0"), info
    total_blocks = int(value(text, "vllm:kv_cache_total_blocks"))
    for label in ('block_size="16"', f'num_gpu_blocks="{total_blocks}"', 'enable_prefix_caching="True"',
                  'cache_dtype="float32"', 'engine="0"'):
        assert label in info[0], (label, info[0])


def test_dashboard_reads_its_state(vllm_names_server):
    """The built-in dashboard reads the engine's own records, whatever the names on /metrics
    (runs after the test above: the generated tokens it sent are in the totals)."""
    r = httpx.get(vllm_names_server.url + "/dashboard/state", timeout=60)
    assert r.status_code == 200, r.text
    state = r.json()
    assert state["model"] == MODEL and state["requests"]["running"] == 0
    generated = value(scrape(vllm_names_server), "vllm:generation_tokens_total")
    assert state["throughput"]["generation_tokens_total"] == generated >= sum(MAX_TOKENS)
