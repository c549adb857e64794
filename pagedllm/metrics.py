"""Prometheus metrics under vLLM's names with a ``pagedllm:`` prefix, and the stats log line.

Gauges come from the engine core's periodic stats (sent even while idle, so they stay
current); counters and latency histograms are recorded in the front end as outputs arrive.
Each EngineMetrics has its own registry, so several engines in one process do not collide.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.engine.core_messages import CoreStats
from pagedllm.engine.dashboard import DashboardHistory

logger = logging.getLogger(__name__)

PREFIX = "pagedllm:"
LOG_INTERVAL_S = 5.0

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0)


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + list(extra), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r)

        self.model_name = model_name
        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV cache usage, 1 means 100 percent.")
        self.kv_cache_free_blocks = gauge("kv_cache_free_blocks", "KV blocks free (cached or not).")
        self.kv_cache_total_blocks = gauge("kv_cache_total_blocks", "Usable KV blocks in the pool.")
        # KV memory on every backend (blocks held, or pages charged).
        self.kv_cache_resident_bytes = gauge(
            "kv_cache_resident_bytes", "KV cache bytes resident by the engine's accounting.")
        self.kv_cache_token_bytes = gauge(
            "kv_cache_token_bytes", "Resident KV cache bytes holding computed tokens.")
        self.kv_cache_fragmentation_ratio = gauge(
            "kv_cache_fragmentation_ratio", "Share of resident KV cache bytes holding no token.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.num_preemptions = counter("num_preemptions", "Preemptions by the scheduler.")
        self.request_success = counter("request_success", "Finished requests.", ("finished_reason",))
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prefix-cache lookups, in tokens.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prefix-cache hits, in tokens.")
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between output tokens.", _LATENCY_BUCKETS)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS)
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduling.", _REQUEST_BUCKETS)
        # Disaggregated prefill: the KV connector's counters (cumulative in the core).
        self.kv_transfer = {
            key: gauge(f"kv_transfer_{key}", f"KV transfer: {key.replace('_', ' ')} since start.")
            for key in ("blocks_sent", "bytes_sent", "blocks_received", "bytes_received",
                        "seconds", "failed_loads", "expired_holds", "aborted_sends")
        }
        # Speculative decoding (zero without it), vLLM's names.
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Draft verifications (per request and step).")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_decode_num_accepted_tokens_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens at each draft position.", ("position",))
        # Create every labelled child now, so each series is exported from the start.
        for metric in (self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage_perc,
                       self.kv_cache_free_blocks, self.kv_cache_total_blocks, self.prompt_tokens,
                       self.kv_cache_resident_bytes, self.kv_cache_token_bytes,
                       self.kv_cache_fragmentation_ratio,
                       self.generation_tokens, self.num_preemptions, self.prefix_cache_queries,
                       self.prefix_cache_hits, self.time_to_first_token, self.inter_token_latency,
                       self.e2e_request_latency, self.request_queue_time, self.spec_decode_num_drafts,
                       self.spec_decode_num_draft_tokens, self.spec_decode_num_accepted_tokens):
            self._l(metric)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name=model_name, finished_reason=reason)
        self._last_preemptions = 0
        self.last_stats: CoreStats | None = None
        self._log_prompt_tokens = 0
        self._log_generation_tokens = 0
        self._log_queries = 0
        self._log_hits = 0
        self._log_draft_tokens = 0
        self._log_accepted_tokens = 0
        self._log_drafts = 0
        self._spec_enabled = False
        self._last_log = time.monotonic()
        self._logged_idle = False
        self.history = DashboardHistory()  # recent records for GET /dashboard/state

    def _l(self, metric):  # the child for this engine's model name
        return metric.labels(model_name=self.model_name)

    # ---- from the engine core ---------------------------------------------------------

    def record_stats(self, stats: CoreStats) -> None:
        s = stats.scheduler_stats
        self.last_stats = stats
        self._l(self.num_requests_running).set(s.num_running)
        self._l(self.num_requests_waiting).set(s.num_waiting)
        self._l(self.kv_cache_usage_perc).set(s.kv_cache_usage)
        self._l(self.kv_cache_free_blocks).set(stats.num_free_blocks)
        self._l(self.kv_cache_total_blocks).set(stats.num_total_blocks)
        self._l(self.kv_cache_resident_bytes).set(s.kv_resident_bytes)
        self._l(self.kv_cache_token_bytes).set(s.kv_token_bytes)
        self._l(self.kv_cache_fragmentation_ratio).set(s.kv_fragmentation)
        if s.num_preemptions > self._last_preemptions:
            self._l(self.num_preemptions).inc(s.num_preemptions - self._last_preemptions)
            self._last_preemptions = s.num_preemptions
        pc = s.prefix_cache_stats  # an interval: add it up
        self._l(self.prefix_cache_queries).inc(pc.queries)
        self._l(self.prefix_cache_hits).inc(pc.hits)
        self._log_queries += pc.queries
        self._log_hits += pc.hits
        for t in stats.queue_times:
            self._l(self.request_queue_time).observe(t)
        self.history.observe_stats(s.num_running, s.num_waiting, s.kv_cache_usage, pc.queries, pc.hits)
        for key, value in (stats.kv_transfer or {}).items():
            if key in self.kv_transfer:
                self._l(self.kv_transfer[key]).set(value)
        if s.spec_decoding_stats is not None:
            self._record_spec(s.spec_decoding_stats)

    def _record_spec(self, spec) -> None:  # spec: SpecDecodingStats over an interval
        self._spec_enabled = True
        self._l(self.spec_decode_num_drafts).inc(spec.num_drafts)
        self._l(self.spec_decode_num_draft_tokens).inc(spec.num_draft_tokens)
        self._l(self.spec_decode_num_accepted_tokens).inc(spec.num_accepted_tokens)
        for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
            self.spec_decode_num_accepted_tokens_per_pos.labels(model_name=self.model_name, position=str(pos)).inc(n)
        self._log_drafts += spec.num_drafts
        self._log_draft_tokens += spec.num_draft_tokens
        self._log_accepted_tokens += spec.num_accepted_tokens

    # ---- from the front end's output processing ---------------------------------------

    def observe_first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        self._l(self.time_to_first_token).observe(ttft)
        self._l(self.prompt_tokens).inc(num_prompt_tokens)
        self._log_prompt_tokens += num_prompt_tokens
        self.history.observe_first_token(ttft, num_prompt_tokens)

    def observe_tokens(self, num_tokens: int, itl: float | None) -> None:
        self._l(self.generation_tokens).inc(num_tokens)
        self._log_generation_tokens += num_tokens
        if itl is not None:
            self._l(self.inter_token_latency).observe(itl)
        self.history.observe_tokens(num_tokens, itl)

    def observe_finished(self, finish_reason: str, e2e: float) -> None:
        self.request_success.labels(model_name=self.model_name, finished_reason=finish_reason).inc()
        self._l(self.e2e_request_latency).observe(e2e)

    # ---- output ------------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def maybe_log(self, now: float | None = None) -> bool:
        """Log the stats line when LOG_INTERVAL_S has passed; True if it logged."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._last_log
        if elapsed < LOG_INTERVAL_S or self.last_stats is None:
            return False
        s = self.last_stats.scheduler_stats
        idle = not (s.num_running or s.num_waiting or self._log_prompt_tokens or self._log_generation_tokens)
        if idle and self._logged_idle:
            self._last_log = now
            return False  # one line for an idle stretch is enough
        self._logged_idle = idle
        hit_rate = self._log_hits / self._log_queries if self._log_queries else 0.0
        spec = ""
        if self._spec_enabled:
            rate = self._log_accepted_tokens / self._log_draft_tokens if self._log_draft_tokens else 0.0
            # Tokens per verification: the accepted drafts plus the one the target adds.
            length = 1 + self._log_accepted_tokens / self._log_drafts if self._log_drafts else 0.0
            spec = f", spec decode acceptance rate {100 * rate:.1f}%, mean acceptance length {length:.2f}"
        logger.info(
            "Engine: running %d, waiting %d, KV cache usage %.1f%%, prompt %.1f tok/s, "
            "generation %.1f tok/s, prefix cache hit rate %.1f%%%s",
            s.num_running, s.num_waiting, 100 * s.kv_cache_usage,
            self._log_prompt_tokens / elapsed, self._log_generation_tokens / elapsed, 100 * hit_rate, spec,
        )
        self._log_prompt_tokens = self._log_generation_tokens = self._log_queries = self._log_hits = 0
        self._log_drafts = self._log_draft_tokens = self._log_accepted_tokens = 0
        self._last_log = now
        return True
