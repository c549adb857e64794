"""Plain data the engine core hands to the engine: per-request outputs and stats."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.sched_output import PositionLogprobsData


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step produced for one request (only requests that sampled, or finished)."""

    request_id: str
    new_token_ids: list[int]
    """Tokens appended this step (one per step until speculative decoding). A stop token
    that ended the request is included; tokens sampled after it are dropped."""
    finish_reason: str | None
    """"stop" or "length" when this step finished the request, else None."""
    stop_reason: int | str | None
    """The stop token id that ended the request; None for EOS, length or still running."""
    num_cached_tokens: int
    """Prompt tokens served by the prefix cache at the request's first scheduling."""
    new_logprobs: list[PositionLogprobsData] | None = None
    """Per token in new_token_ids, when the request asked for logprobs."""
    prompt_logprobs: list[PositionLogprobsData] | None = None
    """Once, with the first output token, when the request asked for prompt logprobs."""
    beams: list | None = None
    """A finished beam search: its sequences (engine.beam_search.BeamSearchSequence), best
    first. Set only on the one output that ends a search."""
    kv_transfer_params: dict | None = None
    """Disaggregated prefill: set when a prefill instance holds the prompt's KV for a pull."""
    error: str | None = None
    """Why the core failed the request (finish_reason "abort"), for the client to read."""
    retryable: bool = False
    """The failure is one of resources, not of the request (a KV pull that failed): the server
    answers 503 with Retry-After; otherwise (a step that raised) 500."""
    invalid: bool = False
    """The failure is the request's own (a constraint no token of the vocabulary can follow):
    the server answers 400."""
    scheduled_time: float | None = None
    """Set by the engine-core process on a request's first output: ``time.monotonic()`` at
    the start of the step that first scheduled it (the front end's clock too: one machine)."""
    pooled: list[float] | None = None
    """A pooling request's output vector (finish_reason "stop", no tokens)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups over an interval, counted in tokens (as vLLM)."""

    requests: int = 0
    """Lookups made. A request looked up again (after a preemption, or because the pool
    could not admit it last step) counts again, as in vLLM."""
    queries: int = 0
    """Tokens looked up."""
    hits: int = 0
    """Tokens found in the cache."""

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(slots=True)
class SpecDecodingStats:
    """Speculative decoding over an interval (as vLLM's counters)."""

    num_spec_tokens: int
    """k: drafts proposed per request and step at most."""
    num_drafts: int = 0
    """Verification runs (one per request and step with drafts)."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] | None = None
    """Accepted drafts at each of the k positions."""

    def __post_init__(self) -> None:
        if self.num_accepted_tokens_per_pos is None:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass(slots=True)
class SchedulerStats:
    """A snapshot for metrics and the periodic log line."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    """Fraction of the usable KV blocks held by requests, 0.0 .. 1.0."""
    num_preemptions: int
    """Preemptions since the scheduler started (a counter, never reset)."""
    prefix_cache_stats: PrefixCacheStats
    """Lookups since the previous ``get_stats()`` call (an interval, reset by each call)."""
    kv_resident_bytes: int = 0
    """KV memory in use by the KV backend's accounting (``KVManager.resident_bytes``: blocks
    held, or pages charged)."""
    kv_token_bytes: int = 0
    """Of it, bytes holding computed tokens of running requests (K and V, every layer)."""
    spec_decoding_stats: SpecDecodingStats | None = None
    """Drafts since the previous ``get_stats()`` call; None without speculative decoding."""
    num_paused: int = 0
    """Sequences paused by the front end (their clients stopped reading), out of the batch."""
    kv_offload: dict[str, dict[str, int]] | None = None
    """Per KV offload tier ("cpu", "disk"): hits, misses, stores, rejected blocks since the
    previous ``get_stats()`` call, and bytes held now; None without tiers."""

    @property
    def kv_fragmentation(self) -> float:
        """Internal fragmentation: the share of resident KV bytes holding no token."""
        if self.kv_resident_bytes <= 0:
            return 0.0
        return max(0.0, 1.0 - self.kv_token_bytes / self.kv_resident_bytes)
