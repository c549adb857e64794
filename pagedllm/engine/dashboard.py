"""The front end's records for the dashboard: recent latencies, token counters and a
time series of the last minutes, kept as outputs and stats arrive (see metrics.py).

Everything here is O(1) per observation; the summary is computed when a viewer asks.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, NamedTuple

import numpy as np

SERIES_INTERVAL_S = 1.0
"""One time-series point per second at most (stats arrive every 0.25-0.5 s)."""
SERIES_LEN = 300
"""Points kept: the last five minutes."""
LATENCY_WINDOW_S = 60.0
"""TTFT and inter-token latency percentiles are over this window."""
RATE_WINDOW_S = 5.0
"""Current token rates are over about this window."""
_MAX_LATENCY_SAMPLES = 20_000


class _Point(NamedTuple):
    time: float
    prompt_tokens: int
    """Cumulative counters since start (the rates are their differences)."""
    generation_tokens: int
    prefix_queries: int
    prefix_hits: int
    num_running: int
    num_waiting: int
    kv_usage: float


class DashboardHistory:
    """Recent front-end records: what the dashboard shows besides the block map."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_running = 0
        self.num_waiting = 0
        self.kv_usage = 0.0
        self._ttft: deque[tuple[float, float]] = deque(maxlen=_MAX_LATENCY_SAMPLES)  # (time, s)
        self._itl: deque[tuple[float, float]] = deque(maxlen=_MAX_LATENCY_SAMPLES)
        self._series: deque[_Point] = deque(maxlen=SERIES_LEN)
        # KV offload tiers: cumulative block counts per tier (docs/kv_offload.md).
        self.offload_tiers: dict[str, dict[str, int]] = {}

    # ---- observations (called from EngineMetrics) --------------------------------------

    def observe_first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        self._ttft.append((time.monotonic(), ttft))
        self.prompt_tokens += num_prompt_tokens

    def observe_tokens(self, num_tokens: int, itl: float | None) -> None:
        self.generation_tokens += num_tokens
        if itl is not None:
            self._itl.append((time.monotonic(), itl))

    def observe_stats(self, num_running: int, num_waiting: int, kv_usage: float,
                      prefix_queries: int, prefix_hits: int) -> None:
        """The engine's periodic stats (prefix-cache lookups are the interval's)."""
        self.num_running, self.num_waiting, self.kv_usage = num_running, num_waiting, kv_usage
        self.prefix_queries += prefix_queries
        self.prefix_hits += prefix_hits
        now = time.monotonic()
        if not self._series or now - self._series[-1].time >= SERIES_INTERVAL_S:
            self._series.append(self._point(now))

    def observe_offload(self, tiers: dict[str, dict[str, int]]) -> None:
        """The interval's KV offload counts per tier (SchedulerStats.kv_offload)."""
        for tier, counts in tiers.items():
            total = self.offload_tiers.setdefault(tier, {"hits": 0, "misses": 0, "stores": 0, "rejected": 0})
            for key in total:
                total[key] += counts[key]

    def _point(self, now: float) -> _Point:
        return _Point(now, self.prompt_tokens, self.generation_tokens, self.prefix_queries,
                      self.prefix_hits, self.num_running, self.num_waiting, self.kv_usage)

    # ---- the summary -------------------------------------------------------------------

    def summary(self, now: float | None = None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        current = self._point(now)
        past = [p for p in self._series if now - p.time >= RATE_WINDOW_S]
        base = past[-1] if past else (self._series[0] if self._series else current)
        window = max(now - base.time, 1e-9)
        minute = [p for p in self._series if now - p.time <= LATENCY_WINDOW_S]
        first = minute[0] if minute else current
        queries = current.prefix_queries - first.prefix_queries
        hits = current.prefix_hits - first.prefix_hits
        return {
            "throughput": {
                "prompt_tokens_per_s": (current.prompt_tokens - base.prompt_tokens) / window,
                "generation_tokens_per_s": (current.generation_tokens - base.generation_tokens) / window,
                "window_s": window if base is not current else 0.0,
                "prompt_tokens_total": current.prompt_tokens,
                "generation_tokens_total": current.generation_tokens,
            },
            "prefix_cache": {
                "hit_rate": hits / queries if queries else None,
                "hit_rate_total": current.prefix_hits / current.prefix_queries
                if current.prefix_queries else None,
                "queries_total": current.prefix_queries,
                "hits_total": current.prefix_hits,
                "offload_tiers": {
                    tier: {**c, "hit_rate": c["hits"] / (c["hits"] + c["misses"]) if c["hits"] + c["misses"] else None}
                    for tier, c in self.offload_tiers.items()
                },
            },
            "latency": {
                "window_s": LATENCY_WINDOW_S,
                "ttft_s": _percentiles(self._ttft, now),
                "itl_s": _percentiles(self._itl, now),
            },
            "history": self._history(now),
        }

    def _history(self, now: float) -> dict[str, list]:
        """Per series point: seconds before now, rates since the previous point, gauges."""
        points = list(self._series)
        out: dict[str, list] = {"t": [], "prompt_tokens_per_s": [], "generation_tokens_per_s": [],
                                "kv_usage": [], "num_running": [], "num_waiting": []}
        for prev, p in zip(points, points[1:]):
            dt = max(p.time - prev.time, 1e-9)
            out["t"].append(round(p.time - now, 2))
            out["prompt_tokens_per_s"].append(round((p.prompt_tokens - prev.prompt_tokens) / dt, 2))
            out["generation_tokens_per_s"].append(
                round((p.generation_tokens - prev.generation_tokens) / dt, 2))
            out["kv_usage"].append(round(p.kv_usage, 4))
            out["num_running"].append(p.num_running)
            out["num_waiting"].append(p.num_waiting)
        return out


def _percentiles(samples: deque[tuple[float, float]], now: float) -> dict[str, Any]:
    """p50/p90/p99 (seconds) of the samples within the latency window."""
    while samples and now - samples[0][0] > LATENCY_WINDOW_S:
        samples.popleft()
    if not samples:
        return {"count": 0, "p50": None, "p90": None, "p99": None}
    values = np.fromiter((v for _, v in samples), dtype=np.float64, count=len(samples))
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"count": len(values), "p50": float(p50), "p90": float(p90), "p99": float(p99)}
