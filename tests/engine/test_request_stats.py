"""Per-request phase times and the metrics they feed, under both namings (no server)."""

from __future__ import annotations

import pytest

from pagedllm.engine.request_stats import RequestStatsTracker
from pagedllm.metrics import EngineMetrics, buckets_1_2_5
from pagedllm.outputs import CompletionOutput, RequestOutput
from tests.entrypoints.utils import metric_value


def finished_output(request_id: str, lengths: list[int], arrival: float) -> RequestOutput:
    outs = [CompletionOutput(index=i, text="", token_ids=list(range(n)), finish_reason="length")
            for i, n in enumerate(lengths)]
    return RequestOutput(request_id, "p", [1, 2, 3, 4], outs, finished=True, metrics={"arrival_time": arrival})


def test_phases_on_one_clock():
    t = RequestStatsTracker()
    t.add("r", max_tokens=8)
    t.scheduled("r", 10.5)
    t.scheduled("r", 11.0)  # a second sequence's scheduling is later: the first counts
    for now in (11.0, 11.2, 11.4, 11.6):
        t.tokens("r", now)
    s = t.finish(finished_output("r", [4], arrival=10.0), "length", now=11.7)
    assert len(t) == 0
    assert s.queued_time == pytest.approx(0.5) and s.prefill_time == pytest.approx(0.5)
    assert s.decode_time == pytest.approx(0.6) and s.inference_time == pytest.approx(1.1)
    assert s.e2e_latency == pytest.approx(1.7) and s.mean_time_per_output_token == pytest.approx(0.2)
    assert (s.num_prompt_tokens, s.num_generation_tokens, s.max_num_generation_tokens, s.n) == (4, 4, 4, 1)
    # n = 2: tokens of both sequences, the longest for the per-token mean.
    t.add("g", max_tokens=None)
    t.scheduled("g", 1.0)
    t.tokens("g", 2.0)
    t.tokens("g", 4.0)
    g = t.finish(finished_output("g", [3, 5], arrival=0.0), "length", now=4.5)
    assert (g.num_generation_tokens, g.max_num_generation_tokens, g.n) == (8, 5, 2)
    assert g.mean_time_per_output_token == pytest.approx(2.0 / 4)
    # Never scheduled (unknown to the tracker): only what the output tells.
    u = t.finish(finished_output("u", [1], arrival=0.0), "stop", now=1.0)
    assert u.queued_time is None and u.prefill_time is None and u.mean_time_per_output_token is None


def test_buckets_and_namings():
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100) and buckets_1_2_5(4096)[-1] == 2000
    t = RequestStatsTracker()
    t.add("r", max_tokens=8)
    t.scheduled("r", 1.0)
    t.tokens("r", 1.5)
    t.tokens("r", 2.0)
    stats = t.finish(finished_output("r", [2], arrival=0.5), "length", now=2.1)
    for naming, prefix, labels in (("pagedllm", "pagedllm:", {"model_name": "m"}),
                                   ("vllm", "vllm:", {"model_name": "m", "engine": "0"})):
        m = EngineMetrics("m", naming)
        m.engine_ready(512, {"block_size": 16, "num_gpu_blocks": 100})
        m.observe_finished("length", stats.e2e_latency, stats)
        text = m.render().decode()
        assert metric_value(text, f"{prefix}request_success_total", labels | {"finished_reason": "length"}) == 1
        assert metric_value(text, f"{prefix}request_prefill_time_seconds_sum", labels) == pytest.approx(0.5)
        assert metric_value(text, f"{prefix}request_decode_time_seconds_sum", labels) == pytest.approx(0.5)
        assert metric_value(text, f"{prefix}request_generation_tokens_sum", labels) == 2
        assert metric_value(text, f"{prefix}request_params_max_tokens_bucket", labels | {"le": "10.0"}) == 1
        assert metric_value(text, f"{prefix}request_params_max_tokens_bucket", labels | {"le": "5.0"}) == 0
        # As vLLM's: the config's fields (and the engine), no model_name.
        info = {k: v for k, v in labels.items() if k != "model_name"} | {"num_gpu_blocks": "100", "block_size": "16"}
        assert metric_value(text, f"{prefix}cache_config_info", info) == 1
        assert (metric_value(text, f"{prefix}gpu_cache_usage_perc", labels) is not None) == (naming == "vllm")
        other = "vllm:" if naming == "pagedllm" else "pagedllm:"
        assert other not in text
    with pytest.raises(ValueError):
        EngineMetrics("m", "prometheus")
