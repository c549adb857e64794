"""The executor registry: ``distributed_executor_backend`` -> executor class.

A module of its own, so the base class (executor.py) never imports its subclasses; Ray itself
is imported only when the ``ray`` executor launches its workers.
"""

from __future__ import annotations

from pagedllm.config import ParallelConfig
from pagedllm.distributed.executor import DistributedExecutor
from pagedllm.distributed.mp_executor import MPExecutor
from pagedllm.distributed.ray_executor import RayExecutor
from pagedllm.distributed.worker import ModelLoadSpec

EXECUTORS: dict[str, type[DistributedExecutor]] = {"mp": MPExecutor, "ray": RayExecutor}
"""Executors of tensor_parallel_size > 1 (``uni`` runs one rank in process, with none)."""


def create_executor(config: ParallelConfig, load: ModelLoadSpec) -> DistributedExecutor:
    backend = config.distributed_executor_backend or "mp"
    executor_cls = EXECUTORS.get(backend)
    if executor_cls is None:
        raise ValueError(
            f"distributed_executor_backend={backend!r} cannot run tensor_parallel_size="
            f"{config.tensor_parallel_size}; use 'mp' (this machine) or 'ray' (a Ray cluster)"
        )
    return executor_cls(config, load)
