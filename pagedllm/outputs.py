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


@dataclass(slots=True)
class PoolingOutput:
    """A pooling request's output vector, under vLLM's names for each task."""

    data: list[float]

    @property
    def embedding(self) -> list[float]:
        return self.data

    @property
    def probs(self) -> list[float]:
        return self.data

    @property
    def score(self) -> float:
        """A single-label classifier's (a cross-encoder's) score."""
        if len(self.data) != 1:
            raise ValueError(f"score is a single-label output; this one has {len(self.data)} labels")
        return self.data[0]


@dataclass
class PoolingRequestOutput:
    """What a pooling request (LLM.embed/classify/score/encode) gets back."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
