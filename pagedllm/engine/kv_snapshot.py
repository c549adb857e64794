"""The dashboard's snapshot of the engine: the KV backend's view and the queue figures.

Taken in the engine core between steps (plain data, pickled to the front end). The KV part
is whatever the backend draws (``KVBackend.view``: a block map, or reserved and resident
pages per request); the rest is the same on every backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.kv_backends import get_kv_backend

if TYPE_CHECKING:
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.kv_backends.base import KVView


@dataclass
class KVSnapshot:
    kv: KVView
    """The backend's picture of its KV memory."""
    num_running: int
    num_waiting: int
    num_preempted: int
    """Waiting requests that were preempted (they resume by recomputing, with prefix hits)."""
    num_preemptions_total: int
    take_seconds: float = 0.0
    """Time this snapshot took to build in the engine."""
    cost_seconds_mean: float = 0.0
    """Mean full cost of the engine's earlier snapshots (build, pickle, send)."""
    step_seconds_mean: float = 0.0
    """Mean duration of the engine's last 32 steps (the snapshot's cost is against this)."""


def take_kv_snapshot(scheduler: Scheduler) -> KVSnapshot:
    kv = scheduler.kv_cache_manager
    return KVSnapshot(
        kv=get_kv_backend(kv.backend).view(kv, scheduler.running),
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_preempted=sum(r.num_preemptions > 0 for r in scheduler.waiting),
        num_preemptions_total=scheduler.num_preemptions,
    )
