"""The proposer interface, and the part of the model runner a proposer may use."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import nn

    from pagedllm.config import ModelConfig
    from pagedllm.worker.sampling_inputs import CachedRequestState


class DraftBatch(Protocol):
    """A flat batch as the runner builds it (worker/model_runner.py's ``Batch``)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: Any  # AttentionMetadata, or one per KV cache group
    logits_indices: torch.Tensor  # [num_sampling]: the last token of each request that reaches its end


class DraftKV(Protocol):
    """A draft model's own KV cache, laid out as the target's so the target's ids index it."""

    kv_caches: list[torch.Tensor]

    def copy_blocks(self, blocks_to_copy: list[tuple[int, int]]) -> None:
        """Copy-on-write (src -> dst), as the target's cache is copied."""
        ...


@runtime_checkable
class DraftKVHost(Protocol):
    """A KV backend's worker side that can hold a separate draft model's KV (a capability:
    the draft asks for it and refuses by the worker's name where it is absent)."""

    def make_draft_kv(self, model: nn.Module, dtype: str) -> DraftKV:
        """A cache for ``model``'s attention layers (bound to them); ValueError for a model
        or pool it cannot mirror."""
        ...


class RunnerView(Protocol):
    """What proposers use of the model runner (which satisfies this protocol)."""

    model: nn.Module
    model_config: ModelConfig
    block_size: int
    num_blocks: int
    """Blocks of the runner's KV pool (a draft model's own cache has as many, same ids)."""
    num_kv_cache_groups: int
    kv_worker: Any
    """The KV backend's worker side (a ``DraftKVHost`` where it can hold a draft's KV)."""

    def prepare_inputs(self, states: list[CachedRequestState], num_scheduled: list[int]) -> DraftBatch:
        """The flat batch of ``num_scheduled[i]`` tokens of each state from its
        ``num_computed_tokens`` on, decodes (one token) first; KV slots from its block ids."""
        ...


class PrefillChunk(NamedTuple):
    """A request that computed tokens this step without sampling (a prompt's earlier chunk)."""

    state: CachedRequestState
    num_tokens: int
    """Tokens computed from ``state.num_computed_tokens`` on."""


class Proposer(ABC):
    """Drafts the next tokens of requests that just sampled.

    Drafts are deterministic (greedy or looked up), so the rejection sampler's acceptance
    probability of a draft d is the target's p(d) and the output distribution is exact.
    """

    num_speculative_tokens: int

    @abstractmethod
    def propose(
        self, states: list[CachedRequestState], max_model_len: int, prefills: Sequence[PrefillChunk] = ()
    ) -> list[list[int]]:
        """Drafts per state (each may be empty); ``states`` may be empty.

        ``states`` sampled this step: their token ids end in this step's emitted tokens, and
        their ``num_computed_tokens`` is still the first position the target computed this
        step. ``prefills`` computed tokens without sampling. The next step verifies position
        len(token_ids) - 1 plus the drafts, so at most max_model_len - 1 - len(token_ids)."""

    def copy_blocks(self, blocks_to_copy: list[tuple[int, int]]) -> None:
        """Copy-on-write of the proposer's own KV blocks (src -> dst), as the runner does for
        the target's before the step's forward. Proposers without a KV cache have none."""

    def max_drafts(self, states: list[CachedRequestState], max_model_len: int) -> list[int]:
        return [min(self.num_speculative_tokens, max_model_len - 1 - len(s.token_ids)) for s in states]
