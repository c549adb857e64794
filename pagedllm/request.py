"""The engine core's view of a request: token ids, progress, status."""

from __future__ import annotations

import enum
import time

from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # blocks allocated, KV being pulled from a prefill instance
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """A request inside the engine core.

    ``num_tokens`` (prompt + output so far) and ``num_computed_tokens`` (tokens whose KV is in
    the cache) are the whole model of work: the scheduler closes the gap between them.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_ids",
        "arrival_time",
        "output_token_ids",
        "all_token_ids",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "status",
        "stop_reason",
        "max_tokens",
        "cache_salt",
        "group_id",
        "pending_forks",
        "kv_transfer_params",
        "spec_token_ids",
        "priority",
        "lora_request",
        "pooling_params",
        "reads_whole_prompt",
        "mm_features",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        max_tokens: int | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        group_id: str | None = None,
        kv_transfer_params: dict | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
        reads_whole_prompt: bool = False,
        mm_features: list[MultiModalFeature] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Resolved output cap: sampling_params.max_tokens, bounded by max_model_len.
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        # Folded into the first block's prefix-cache hash: only requests with the same salt
        # share cached KV (isolation between tenants, as vLLM's cache_salt).
        self.cache_salt = cache_salt
        # Sequences of one parent request (n > 1) share group_id; the scheduler admits,
        # preempts and resumes them together. The first sequence (the leader) computes the
        # prompt but its last token; then the others fork from it (pending_forks) and share
        # its blocks.
        self.group_id = group_id
        self.pending_forks: list[Request] = []
        # Disaggregated prefill (distributed/kv_transfer/): {"do_remote_decode": true} on a
        # prefill instance; on a decode instance, where to pull the prompt's KV blocks from.
        self.kv_transfer_params = kv_transfer_params
        # Draft tokens proposed for the next step (speculative decoding); never part of
        # all_token_ids, so they are never hashed into the prefix cache.
        self.spec_token_ids: list[int] = []
        # --scheduling-policy priority: lower values are scheduled first, ties by arrival.
        self.priority = priority
        # The LoRA adapter the request runs with (None: the base model); part of its first
        # block's prefix-cache hash, so KV is shared only between requests of one adapter.
        self.lora_request = lora_request
        # A pooling request (pooling_params.py): its prompt is computed, pooled, and it
        # finishes with no output token. reads_whole_prompt: its pooling reads every prompt
        # token's state (mean or first-token pooling, bidirectional attention), so it takes
        # no prefix-cache hit.
        self.pooling_params = pooling_params
        self.reads_whole_prompt = reads_whole_prompt
        # The prompt's images (multimodal/inputs.py), in prompt order; None: text only. Their
        # hashes enter the prefix-cache hashes of the blocks that hold them (mm_block_keys).
        self.mm_features = mm_features

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.name})"
        )
