"""`pagedllm bench serve`'s arithmetic, as `vllm bench serve` defines it.

- TTFT: send to the first chunk with text. ITL: between consecutive chunks with text. E2EL:
  send to the end of the stream. TPOT (per request): ``(e2el - ttft) / (output_tokens - 1)``,
  for requests with more than one output token.
- Percentiles: numpy's (linear interpolation) over the successful requests, reported as
  ``p{P}_{metric}_ms`` (``P`` without ".0" when whole), with mean, median and std
  (population).
- Goodput (``--goodput ttft:500 tpot:50 e2el:2000``, milliseconds): successful requests that
  meet every given objective (a request with one output token has TPOT 0), per second.
- Arrivals: with ``--request-rate R`` the gaps are gamma-distributed with shape ``b =
  --burstiness`` and scale ``1 / (R b)`` (b = 1: Poisson; b < 1 burstier, b > 1 steadier),
  then scaled so the last request goes out at ``num_prompts / R``; R = inf sends all at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start_time: float = 0.0
    """When the request was sent (perf_counter seconds)."""
    generated_text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = float("nan")
        if not sep or ms != ms:
            raise ValueError(f"--goodput {pair!r}: give KEY:MILLISECONDS, KEY one of {', '.join(GOODPUT_METRICS)}")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {pair!r}: {name!r} is not one of {', '.join(GOODPUT_METRICS)}")
        if ms < 0:
            raise ValueError(f"--goodput {pair!r}: the objective must be >= 0")
        slos[name] = ms
    return slos


def parse_percentiles(text: str) -> list[float]:
    values = [float(p) for p in text.split(",") if p.strip()]
    if not values or any(not 0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles {text!r}: comma-separated numbers in [0, 100]")
    return values


def parse_percentile_metrics(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in PERCENTILE_METRICS]
    if bad or not names:
        raise ValueError(f"--percentile-metrics {text!r}: names among {', '.join(PERCENTILE_METRICS)}")
    return names


def is_good(r: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(values[name] <= ms / 1000.0 for name, ms in slos.items())


def arrival_times(num: int, request_rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send offsets in seconds from the start, one per request."""
    if not burstiness > 0:
        raise ValueError(f"--burstiness {burstiness} must be > 0")
    if request_rate == float("inf") or num == 0:
        return np.zeros(num)
    if not request_rate > 0:
        raise ValueError(f"--request-rate {request_rate} must be > 0")
    if burstiness == float("inf"):
        gaps = np.full(num, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)
    times = np.cumsum(gaps)
    return times * (num / request_rate / times[-1])


def _word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def metric_stats(name: str, values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    """mean/median/std/pP of a metric given in seconds, as ``{stat}_{name}_ms`` keys."""
    arr = np.asarray(values_s if values_s else [0.0], dtype=float) * 1000.0
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    for p in percentiles:
        out[f"p{_word(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def peak_figures(ok: list[RequestResult]) -> tuple[float, int]:
    """(most output tokens in one second of the run, most requests in flight at once)."""
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    end = max(r.start_time + r.latency for r in ok)
    per_second = np.zeros(int(np.ceil(end - t0)) + 1)
    for r in ok:
        token_times = r.start_time + r.ttft + np.concatenate(([0.0], np.cumsum(r.itl)))
        np.add.at(per_second, (token_times - t0).astype(int), 1)
    # Half-open [start, end): a departure at t precedes an arrival at t.
    events = sorted([(r.start_time, 1) for r in ok] + [(r.start_time + r.latency, -1) for r in ok])
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return float(per_second.max()), peak


def summarize(results: list[RequestResult], duration: float, percentile_metrics: list[str] | tuple[str, ...] = PERCENTILE_METRICS,
              percentiles: list[float] | None = None, goodput: dict[str, float] | None = None) -> dict:
    """vLLM's result fields for one run."""
    percentiles = [99.0] if percentiles is None else percentiles
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    peak_tokens, peak_requests = peak_figures(ok)
    out: dict = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": sum(is_good(r, goodput) for r in ok) / duration if goodput else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
    }
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for t in (r.tpot for r in ok) if t is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for name in percentile_metrics:
        out |= metric_stats(name, values[name], percentiles)
    return out
