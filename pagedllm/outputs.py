"""What a user gets back: RequestOutput with one CompletionOutput per sequence (as vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """"stop" (EOS, stop string or stop token), "length", "abort", or None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the output; None for EOS or length."""

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
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    metrics: dict = field(default_factory=dict)
    """Timings in seconds: arrival, first_token, finished (monotonic clock)."""
