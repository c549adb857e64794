"""The worker-side KV protocol: a backend's KV tensors and each step's attention metadata.

The runner builds, per step, where each scheduled token sits (``StepIndex``: positions, the
request of each token, sequence lengths; host-side int64 tensors) and hands it with each
request's ids (``block_ids[group]``, from the backend's manager) to its ``KVCacheWorker``,
which returns the ``AttentionMetadata`` the Attention layers read (on the worker's device).
Before the forward, ``prepare`` applies what the scheduler decided about memory (blocks
copied on write, slots released). The Attention layers write and read the caches bound to
them through that metadata, in the layout the worker declares (attention/layouts.py: block
tables or contiguous slots); the attention backend completes it (``prepare_metadata``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.attention.layouts import KVLayout
from pagedllm.attention.metadata import AttentionMetadata


class StepIndex(NamedTuple):
    """Where this step's tokens sit: requests ordered decodes first, T tokens, R requests."""

    positions: torch.Tensor  # [T] int64, position of each token in its request
    req_of_token: torch.Tensor  # [T] int64, row (request) of each token
    seq_lens: torch.Tensor  # [R] int64, context length including this step's tokens
    query_start_loc: list[int]  # [R + 1] token offsets of each request's queries
    seq_lens_list: list[int]  # [R] seq_lens as Python ints
    num_decodes: int  # the first num_decodes requests have exactly one query token


class KVCacheWorker(ABC):
    """Owns the KV tensors of every Attention layer (bound to the layers at construction)."""

    kv_caches: list[torch.Tensor]
    """The distinct cache tensors (a layer reads the one bound to it)."""
    num_groups: int
    """KV cache groups: ``block_ids`` has one list per group."""
    device: torch.device
    layout: KVLayout
    """How the metadata it builds addresses its caches (the attention backend reads it so)."""

    @abstractmethod
    def prepare(self, so: SchedulerOutput) -> None:
        """Before the forward: apply the step's memory decisions (copy-on-write copies,
        releases of freed memory)."""

    def persist_offload(self, ops: Any, timeout_s: float) -> None:
        """At shutdown: copy blocks into the KV offload tiers and wait up to ``timeout_s`` for
        their disk writes (``KVManager.take_persist_ops``; backends without tiers get none)."""

    def read_blocks(self, block_ids: list[int]) -> list[Any]:
        """Images of pool blocks, for saving KV by name (backends with blocks only)."""
        raise ValueError("this KV backend's worker side has no blocks to read")

    @abstractmethod
    def attention_metadata(
        self, block_ids: Sequence[list[list[int]]], step: StepIndex
    ) -> AttentionMetadata | list[AttentionMetadata]:
        """Metadata for this step (one per KV cache group where groups differ);
        ``block_ids[i]`` are request i's ids per group."""
