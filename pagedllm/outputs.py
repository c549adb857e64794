"""What a user gets back: RequestOutput with one CompletionOutput per sequence (as vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One candidate token's log-probability under the model's raw distribution."""

    logprob: float
    rank: int
    """1 for the most likely token."""
    decoded_token: str | None = None


# Per position: token id -> Logprob, for the top-k candidates plus the chosen token.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """"stop" (EOS, stop string or stop token), "length", "abort", or None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the output; None for EOS or length."""
    cumulative_logprob: float | None = None
    """Sum of the chosen tokens' logprobs (set when logprobs were asked for, and for beams)."""
    logprobs: list[PositionLogprobs] | None = None
    """Per output token, when SamplingParams.logprobs is set."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    """Per prompt token (None for the first), when SamplingParams.prompt_logprobs is set."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    metrics: dict = field(default_factory=dict)
    """Timings in seconds: arrival, first_token, finished (monotonic clock)."""
    kv_transfer_params: dict | None = None
    """Disaggregated prefill: where a decode instance pulls this prompt's KV from."""
