"""Plain data crossing the scheduler/runner boundary.

Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute() -> ModelRunnerOutput ->
Scheduler.update_from_output(). The runner keeps per-request state (token ids, block table)
between steps; a SchedulerOutput carries only what changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.structured_output.bitmask import GrammarBitmask


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen, or is seeing again after preemption."""

    req_id: str
    token_ids: list[int]
    """Prompt plus any output so far (a resumed request recomputes both)."""
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[list[int]]
    """Physical block ids per KV cache group: block_ids[group][logical_block]."""
    num_computed_tokens: int
    """Tokens whose KV is already in the cache (prefix-cache hit)."""
    lora_request: LoRARequest | None = None
    """The adapter the request runs with (None: the base model)."""
    pooling_params: PoolingParams | None = None
    """A pooling request: the runner pools its prompt instead of sampling."""
    mm_features: list[MultiModalFeature] | None = None
    """The prompt's images: the runner encodes them and writes their rows over the placeholders."""


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds: only the newly appended blocks."""

    req_id: str
    new_block_ids: list[list[int]]
    """Blocks appended since the last step, per KV cache group."""
    num_computed_tokens: int
    copied_blocks: list[tuple[int, int]] = field(default_factory=list)
    """Copy-on-write this step: in the request's block table, block src becomes dst."""


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    """Tokens to compute this step, per request id."""
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests finished or preempted since the last step: the runner drops their state."""
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    """(src, dst) physical blocks: copy src's KV into dst in every layer before the forward
    (copy-on-write of a shared, partly filled block)."""
    grammar_bitmask: GrammarBitmask | None = None
    """Allowed tokens of the constrained requests that sample this step (set by the engine
    core's StructuredOutputManager after scheduling); the runner masks their logits."""
    kv_slots_to_release: list[int] = field(default_factory=list)
    """Ids whose memory the KV backend's worker side releases before the forward
    (``KVManager.take_slots_to_release``; empty for backends that reuse memory in place)."""
    kv_connector_metadata: Any = None
    """Disaggregated prefill: a KVConnectorMetadata for the connector's worker side (or None)."""
    kv_offload: Any = None
    """KV offload tiers: the paged backend's OffloadOps (blocks to copy out of the pool and
    into it before the forward; ``KVManager.take_offload_ops``), or None."""
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    """Draft tokens to verify, per request id; they are the last len(drafts) of the request's
    num_scheduled_tokens."""

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class PositionLogprobsData:
    """Logprobs at one position: the chosen (or actual prompt) token first, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int
    """Rank of the chosen token under the model's raw distribution (1 = most likely)."""


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    """Requests that sampled a token this step, in the runner's order."""
    sampled_token_ids: list[list[int]]
    """New tokens per request in req_ids: one, or with drafts the accepted ones plus one."""
    logprobs: list[list[PositionLogprobsData] | None] | None = None
    """Per request in req_ids, per new token (None: not asked for); None if no request asked."""
    prompt_logprobs: dict[str, list[PositionLogprobsData]] = field(default_factory=dict)
    """For requests that sampled their first token this step and asked for prompt logprobs:
    one entry per prompt token after the first."""
    kv_connector_output: Any = None
    """Disaggregated prefill: a KVConnectorOutput, the transfers that ended (or None)."""
    spec_token_ids: list[list[int]] | None = None
    """Drafts proposed for the next step, per request in req_ids (None: no speculation)."""
    failed: dict[str, str] = field(default_factory=dict)
    """Requests whose own processing raised this step (request id -> message): the engine
    core fails them alone and drops whatever they sampled."""
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    """Pooling requests whose prompt ended this step: request id -> its output vector."""
