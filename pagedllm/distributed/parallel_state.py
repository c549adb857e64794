"""The tensor-parallel group a model is built for, and its two collectives.

Layers read the group once, at construction (`current_tp()`), inside a
`tensor_parallel(group)` scope; outside any scope the group has size 1 and no collective
ever runs, so a model built without tensor parallelism takes exactly the single-rank path.
The torch.distributed process group (gloo on CPU) is attached to the group after the model
is built (`TPGroup.init_process_group`); collectives only run in forward passes.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 600.0
"""How long a rank waits in a collective for its peers (a dead peer fails it at once)."""


class TPGroup:
    """Rank ``rank`` of ``size`` tensor-parallel ranks."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        assert 0 <= rank < size, (rank, size)
        self.rank = rank
        self.size = size
        self.process_group: dist.ProcessGroup | None = None
        self.all_reduce_seconds = 0.0
        """Time spent in all-reduce and all-gather (benchmarks read it)."""

    def init_process_group(self, init_method: str) -> None:
        """Join the gloo group (blocks until every rank has joined)."""
        if self.size == 1:
            return
        if dist.is_initialized():
            raise ValueError(
                "this process already hosts a tensor-parallel engine (torch.distributed is "
                "initialized); shut it down first (LLM.shutdown()) or use another process"
            )
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=self.rank,
            world_size=self.size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        self.process_group = dist.group.WORLD

    def destroy(self) -> None:
        if self.process_group is not None and dist.is_initialized():
            dist.destroy_process_group()
        self.process_group = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place."""
        assert self.process_group is not None, "tensor-parallel group used before init_process_group"
        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.process_group)
        self.all_reduce_seconds += time.perf_counter() - t0
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` concatenated along the last dimension (rank order)."""
        assert self.process_group is not None, "tensor-parallel group used before init_process_group"
        t0 = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.process_group)
        self.all_reduce_seconds += time.perf_counter() - t0
        return torch.cat(parts, dim=-1)


_SINGLE = TPGroup()
_current: TPGroup = _SINGLE


def current_tp() -> TPGroup:
    """The group of the model being built (size 1 outside `tensor_parallel`)."""
    return _current


@contextlib.contextmanager
def tensor_parallel(group: TPGroup) -> Iterator[TPGroup]:
    """Build models for ``group`` inside this scope."""
    global _current
    previous, _current = _current, group
    try:
        yield group
    finally:
        _current = previous


def divide(total: int, size: int, what: str) -> int:
    if total % size:
        raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={size}")
    return total // size


def check_heads(num_heads: int, num_kv_heads: int, size: int) -> None:
    """Attention heads split across ranks: both head counts must divide by the size."""
    if num_heads % size == 0 and num_kv_heads % size == 0:
        return
    allowed = [n for n in range(1, num_kv_heads + 1) if num_heads % n == 0 and num_kv_heads % n == 0]
    raise ValueError(
        f"tensor_parallel_size={size} does not divide the model's attention heads: "
        f"{num_heads} query heads and {num_kv_heads} KV heads must both be divisible by the "
        f"tensor-parallel size, since each rank holds whole heads (and their share of the KV "
        f"cache); use --tensor-parallel-size in {allowed}"
    )


def shard_range(total: int, group: TPGroup) -> tuple[int, int]:
    """Rows [start, start + per_rank) of a dimension of ``total`` split in equal parts,
    the last padded: per_rank = ceil(total / size) (vocabulary-parallel tables)."""
    per_rank = -(-total // group.size)
    return group.rank * per_rank, per_rank
