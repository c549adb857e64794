"""Per-request phase times for the finished-request histograms (as vLLM's, by phase).

A user request's life, on one monotonic clock (the engine core's stamps and the front end's
agree: one machine):

    arrival --queued--> first scheduled --prefill--> first token --decode--> last token
            \\________________________ e2e (to the finished output) ___________________/

``inference`` is first scheduled to last token (prefill + decode). For n > 1 the request's
sequences count together: the first scheduling and first token of any, the last token of
all. Beam searches are not tracked (their outputs arrive at the end, in one piece).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.outputs import RequestOutput


@dataclass(slots=True)
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    """Generated tokens of all the request's sequences."""
    max_num_generation_tokens: int
    """Of its sequences, the most tokens one generated."""
    n: int
    max_tokens_param: int | None
    queued_time: float | None = None
    """None when unknown (the request never reached the core's scheduler)."""
    prefill_time: float | None = None
    decode_time: float | None = None
    inference_time: float | None = None

    @property
    def mean_time_per_output_token(self) -> float | None:
        """Decode time over the intervals between output tokens (of the longest sequence:
        n > 1 decodes its sequences side by side); None with fewer than two tokens."""
        if self.decode_time is None or self.max_num_generation_tokens < 2:
            return None
        return self.decode_time / (self.max_num_generation_tokens - 1)


@dataclass(slots=True)
class _Times:
    max_tokens: int | None
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None


class RequestStatsTracker:
    """Times of user requests in flight, keyed by user request id."""

    def __init__(self) -> None:
        self._live: dict[str, _Times] = {}

    def __len__(self) -> int:
        return len(self._live)

    def add(self, request_id: str, max_tokens: int | None) -> None:
        self._live[request_id] = _Times(max_tokens)

    def scheduled(self, request_id: str, when: float) -> None:
        times = self._live.get(request_id)
        if times is not None and times.scheduled is None:
            times.scheduled = when

    def tokens(self, request_id: str, now: float) -> None:
        times = self._live.get(request_id)
        if times is None:
            return
        if times.first_token is None:
            times.first_token = now
        times.last_token = now

    def drop(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def finish(self, out: RequestOutput, finish_reason: str, now: float) -> FinishedRequestStats:
        """The stats of a finished request (its times forgotten); counts from its output."""
        times = self._live.pop(out.request_id, None) or _Times(None)
        lengths = [len(c.token_ids) for c in out.outputs] or [0]
        arrival = out.metrics["arrival_time"]
        stats = FinishedRequestStats(
            finish_reason=finish_reason, e2e_latency=now - arrival,
            num_prompt_tokens=len(out.prompt_token_ids or []), num_generation_tokens=sum(lengths),
            max_num_generation_tokens=max(lengths), n=len(out.outputs), max_tokens_param=times.max_tokens,
        )
        if times.scheduled is not None:
            stats.queued_time = max(0.0, times.scheduled - arrival)
            if times.first_token is not None and times.last_token is not None:
                stats.prefill_time = max(0.0, times.first_token - times.scheduled)
                stats.decode_time = times.last_token - times.first_token
                stats.inference_time = max(0.0, times.last_token - times.scheduled)
        return stats
