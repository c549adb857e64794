"""Prometheus metrics under vLLM's names, and the stats log line.

The names are vLLM's with a ``pagedllm:`` prefix and the label ``model_name`` by default;
``--metrics-names vllm`` serves every metric under ``vllm:`` with vLLM's labels
(``model_name``, ``engine``) and vLLM's deprecated aliases that dashboards and autoscalers still
query (``vllm:gpu_cache_usage_perc``), so vLLM's Grafana dashboards work unchanged
(docs/metrics.md maps the names). Bucket edges are vLLM's.

Gauges come from the engine core's periodic stats (sent even while idle, so they stay
current); counters and latency histograms are recorded in the front end as outputs arrive,
the per-request ones (phase times, token counts) when a request finishes. Each
EngineMetrics has its own registry, so several engines in one process do not collide.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.engine.core_messages import CoreStats
from pagedllm.engine.dashboard import DashboardHistory
from pagedllm.engine.request_stats import FinishedRequestStats

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 5.0


@dataclass(frozen=True)
class MetricsNaming:
    prefix: str
    engine_label: bool
    """Add vLLM's ``engine`` label (the engine index; one engine here: "0")."""
    vllm_aliases: bool
    """Also export vLLM's deprecated names that dashboards still query."""


METRICS_NAMINGS: dict[str, MetricsNaming] = {
    "pagedllm": MetricsNaming("pagedllm:", engine_label=False, vllm_aliases=False),
    "vllm": MetricsNaming("vllm:", engine_label=True, vllm_aliases=True),
}
PREFIX = METRICS_NAMINGS["pagedllm"].prefix

# vLLM's bucket edges, metric by metric.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    edges: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(edges)
            edges.append(m * scale)
        scale *= 10


class EngineMetrics:
    def __init__(self, model_name: str, naming: str = "pagedllm") -> None:
        if naming not in METRICS_NAMINGS:
            raise ValueError(f"metrics naming {naming!r} is not one of {', '.join(METRICS_NAMINGS)}")
        self.naming = METRICS_NAMINGS[naming]
        self.registry = CollectorRegistry()
        self._labels = {"model_name": model_name} | ({"engine": "0"} if self.naming.engine_label else {})
        labels = list(self._labels)
        prefix = self.naming.prefix
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(prefix + name, doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(prefix + name, doc, labels + list(extra), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(prefix + name, doc, labels, buckets=buckets, registry=r)

        self._histogram = histogram
        self.model_name = model_name
        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_requests_paused = gauge(
            "num_requests_paused", "Sequences out of the batch because their clients stopped reading.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV cache usage, 1 means 100 percent.")
        # vLLM's name before 0.10; KEDA/HPA rules and the example Grafana dashboard still use it.
        self.gpu_cache_usage_perc = gauge(
            "gpu_cache_usage_perc", "KV cache usage, 1 means 100 percent (vLLM's deprecated name)."
        ) if self.naming.vllm_aliases else None
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
        self.pooling_requests = counter(
            "pooling_requests", "Finished pooling requests (embeddings, classifications, scores), by task.", ("task",))
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prefix-cache lookups, in tokens.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prefix-cache hits, in tokens.")
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS)
        # vLLM's older name of the same observations (its example dashboard's TPOT panel).
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "Time between output tokens (vLLM's older name).", _ITL_BUCKETS)
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds", "Per request: decode time over its output tokens but the first.",
            _ITL_BUCKETS)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS)
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduling.", _REQUEST_BUCKETS)
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduling to first token.", _REQUEST_BUCKETS)
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "First token to last token.", _REQUEST_BUCKETS)
        self.request_inference_time = histogram(
            "request_inference_time_seconds", "First scheduling to last token.", _REQUEST_BUCKETS)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens scheduled per engine step.", _ITERATION_TOKEN_BUCKETS)
        self.request_params_n = histogram("request_params_n", "The n request parameter.", _N_BUCKETS)
        # Token-count histograms and the cache config: once the engine is ready (their buckets
        # reach max_model_len; the config is the loaded engine's).
        self.request_prompt_tokens: Histogram | None = None
        self.request_generation_tokens: Histogram | None = None
        self.request_max_num_generation_tokens: Histogram | None = None
        self.request_params_max_tokens: Histogram | None = None
        self.cache_config_info: Gauge | None = None
        # Disaggregated prefill: the KV connector's counters (cumulative in the core).
        # KV offload tiers (docs/kv_offload.md), by tier ("cpu", "disk"), in blocks.
        self.kv_offload = {
            "hits": counter("kv_offload_hits", "KV offload: blocks found in a tier after a pool miss.", ("tier",)),
            "misses": counter("kv_offload_misses", "KV offload: lookups a tier could not serve.", ("tier",)),
            "stores": counter("kv_offload_stores", "KV offload: blocks stored into a tier.", ("tier",)),
            "rejected": counter(
                "kv_offload_rejected", "KV offload: block files skipped as corrupt, truncated or foreign.",
                ("tier",)),
        }
        self.kv_offload_bytes = Gauge(
            prefix + "kv_offload_bytes", "KV offload: bytes held by a tier.", labels + ["tier"], registry=r)
        self.kv_transfer = {
            key: gauge(f"kv_transfer_{key}", f"KV transfer: {key.replace('_', ' ')} since start.")
            for key in ("blocks_sent", "bytes_sent", "blocks_received", "bytes_received",
                        "seconds", "failed_loads", "expired_holds", "aborted_sends", "dead_threads")
        }
        # Speculative decoding (zero without it), vLLM's names.
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Draft verifications (per request and step).")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_decode_num_accepted_tokens_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens at each draft position.", ("position",))
        # Create every labelled child now, so each series is exported from the start.
        for metric in (self.num_requests_running, self.num_requests_waiting, self.num_requests_paused,
                       self.kv_cache_usage_perc,
                       self.gpu_cache_usage_perc,
                       self.kv_cache_free_blocks, self.kv_cache_total_blocks, self.prompt_tokens,
                       self.kv_cache_resident_bytes, self.kv_cache_token_bytes,
                       self.kv_cache_fragmentation_ratio,
                       self.generation_tokens, self.num_preemptions, self.prefix_cache_queries,
                       self.prefix_cache_hits, self.time_to_first_token, self.inter_token_latency,
                       self.time_per_output_token, self.request_time_per_output_token,
                       self.e2e_request_latency, self.request_queue_time, self.request_prefill_time,
                       self.request_decode_time, self.request_inference_time, self.iteration_tokens,
                       self.request_params_n, self.spec_decode_num_drafts,
                       self.spec_decode_num_draft_tokens, self.spec_decode_num_accepted_tokens):
            if metric is not None:
                self._l(metric)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(**self._labels, finished_reason=reason)
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
        self._replica_metrics: ReplicaMetrics | None = None

    def engine_ready(self, max_model_len: int, cache_info: dict[str, Any]) -> None:
        """Create what needs the loaded engine: the token-count histograms (1-2-5 buckets up
        to max_model_len, as vLLM) and the cache config info (a gauge at 1, its labels the
        config, as vLLM's ``cache_config_info``)."""
        if self.request_prompt_tokens is not None:
            return
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = self._histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", token_buckets)
        self.request_generation_tokens = self._histogram(
            "request_generation_tokens", "Generated tokens per finished request (all its sequences).",
            token_buckets)
        self.request_max_num_generation_tokens = self._histogram(
            "request_max_num_generation_tokens", "Most tokens one sequence of a finished request generated.",
            token_buckets)
        self.request_params_max_tokens = self._histogram(
            "request_params_max_tokens", "The max_tokens request parameter.", token_buckets)
        for metric in (self.request_prompt_tokens, self.request_generation_tokens,
                       self.request_max_num_generation_tokens, self.request_params_max_tokens):
            self._l(metric)
        info = {k: str(v) for k, v in cache_info.items()}
        if self.naming.engine_label:
            info["engine"] = "0"
        self.cache_config_info = Gauge(
            self.naming.prefix + "cache_config_info", "Information of the engine's KV cache config.",
            list(info), registry=self.registry,
        )
        self.cache_config_info.labels(**info).set(1)

    def replica_metrics(self) -> ReplicaMetrics:
        """The per-replica series of data parallelism, in this registry (created once)."""
        if self._replica_metrics is None:
            labels = {"model_name": self.model_name}
            self._replica_metrics = ReplicaMetrics(self.registry, self.naming.prefix, labels)
        return self._replica_metrics

    def _l(self, metric):  # the child for this engine's labels
        return metric.labels(**self._labels)

    # ---- from the engine core ---------------------------------------------------------

    def record_stats(self, stats: CoreStats) -> None:
        s = stats.scheduler_stats
        self.last_stats = stats
        self._l(self.num_requests_running).set(s.num_running)
        self._l(self.num_requests_waiting).set(s.num_waiting)
        self._l(self.num_requests_paused).set(s.num_paused)
        self._l(self.kv_cache_usage_perc).set(s.kv_cache_usage)
        if self.gpu_cache_usage_perc is not None:
            self._l(self.gpu_cache_usage_perc).set(s.kv_cache_usage)
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
        for n in stats.iteration_tokens:
            self._l(self.iteration_tokens).observe(n)
        self.history.observe_stats(s.num_running, s.num_waiting, s.kv_cache_usage, pc.queries, pc.hits)
        if s.kv_offload:
            self.history.observe_offload(s.kv_offload)
        for tier, counts in (s.kv_offload or {}).items():
            for key, metric in self.kv_offload.items():
                metric.labels(**self._labels, tier=tier).inc(counts[key])
            self.kv_offload_bytes.labels(**self._labels, tier=tier).set(counts["bytes"])
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
            self.spec_decode_num_accepted_tokens_per_pos.labels(**self._labels, position=str(pos)).inc(n)
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
            self._l(self.time_per_output_token).observe(itl)
        self.history.observe_tokens(num_tokens, itl)

    def observe_aborted(self) -> None:
        """A request aborted in the front end (client gone, time limit): counted, not timed."""
        self.request_success.labels(**self._labels, finished_reason="abort").inc()

    def observe_pooling(self, task: str, e2e: float) -> None:
        """A finished pooling request (one prompt pooled; no tokens generated)."""
        self.pooling_requests.labels(**self._labels, task=task).inc()
        self.observe_finished("stop", e2e)

    def observe_finished(self, finish_reason: str, e2e: float, stats: FinishedRequestStats | None = None) -> None:
        """A finished request; ``stats`` (its phases and token counts) where they are known.
        The queue time is observed when the core schedules a request (``record_stats``)."""
        self.request_success.labels(**self._labels, finished_reason=finish_reason).inc()
        self._l(self.e2e_request_latency).observe(e2e)
        if stats is None:
            return
        for metric, value in ((self.request_prefill_time, stats.prefill_time),
                              (self.request_decode_time, stats.decode_time),
                              (self.request_inference_time, stats.inference_time),
                              (self.request_time_per_output_token, stats.mean_time_per_output_token)):
            if value is not None:
                self._l(metric).observe(value)
        self._l(self.request_params_n).observe(stats.n)
        if self.request_prompt_tokens is None:
            return  # finished before engine_ready: only in tests that skip it
        self._l(self.request_prompt_tokens).observe(stats.num_prompt_tokens)
        self._l(self.request_generation_tokens).observe(stats.num_generation_tokens)
        self._l(self.request_max_num_generation_tokens).observe(stats.max_num_generation_tokens)
        if stats.max_tokens_param is not None:
            self._l(self.request_params_max_tokens).observe(stats.max_tokens_param)

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


class ReplicaMetrics:
    """Data parallelism's per-replica series (label ``replica``, the replica's index) beside
    the engine's metrics, which are totals over the replicas: whether each is up, its running
    and waiting requests and KV usage (from its stats), requests routed to it, restarts, and
    the requests a death failed or sent elsewhere."""

    def __init__(self, registry: CollectorRegistry, prefix: str, labels: dict[str, str]) -> None:
        self._labels = labels
        names = list(labels) + ["replica"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(prefix + name, doc, names, registry=registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(prefix + name, doc, names, registry=registry)

        self.up = gauge("dp_replica_up", "1 while the data-parallel replica serves, 0 while it is down.")
        self.running = gauge("dp_replica_num_requests_running", "Requests in the replica's running batch.")
        self.waiting = gauge("dp_replica_num_requests_waiting", "Requests waiting in the replica.")
        self.in_flight = gauge("dp_replica_num_requests_in_flight",
                               "Requests the router sent to the replica, not finished.")
        self.kv_usage = gauge("dp_replica_kv_cache_usage_perc", "The replica's KV cache usage, 1 means 100 percent.")
        self.routed = counter("dp_replica_requests_routed", "Requests (sequences) the router sent to the replica.")
        self.restarts = counter("dp_replica_restarts", "Times the replica was started again after dying.")
        self.failed = counter("dp_replica_requests_failed",
                              "Requests that had output when the replica died (their clients got a 503).")
        self.retried = counter("dp_replica_requests_retried",
                               "Requests without output yet when the replica died, sent to another replica.")

    def _r(self, metric, replica: int):
        return metric.labels(**self._labels, replica=str(replica))

    def record_replica(self, replica: int, up: bool, stats: CoreStats | None, num_in_flight: int) -> None:
        self._r(self.up, replica).set(1 if up else 0)
        self._r(self.in_flight, replica).set(num_in_flight)
        s = stats.scheduler_stats if stats is not None else None
        self._r(self.running, replica).set(s.num_running if s is not None else 0)
        self._r(self.waiting, replica).set(s.num_waiting if s is not None else 0)
        self._r(self.kv_usage, replica).set(s.kv_cache_usage if s is not None else 0.0)
        for counter in (self.routed, self.restarts, self.failed, self.retried):
            self._r(counter, replica)  # every series from the start, at 0

    def observe_routed(self, replica: int) -> None:
        self._r(self.routed, replica).inc()

    def observe_replica_restart(self, replica: int) -> None:
        self._r(self.restarts, replica).inc()

    def observe_replica_death(self, replica: int, num_retried: int, num_failed: int) -> None:
        self._r(self.retried, replica).inc(num_retried)
        self._r(self.failed, replica).inc(num_failed)
