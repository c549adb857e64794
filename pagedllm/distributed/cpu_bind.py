"""Thread placement of tensor-parallel ranks: each rank pins itself to its own cores.

``PAGEDLLM_CPU_BIND`` (as vLLM's ``VLLM_CPU_OMP_THREADS_BIND``): the cores of each rank,
ranks separated by ``|``, e.g. ``0-3|4-7`` or ``0,2|1,3``; ``all`` leaves every rank on every
core (no pinning, torch's default thread count). Default: the cores this process may run
on, split evenly between the ranks in order (rank r gets the r-th contiguous share).
Without it, vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` is read the same way (its ``auto``: the
default; its ``nobind``: ``all``).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

ENV = "PAGEDLLM_CPU_BIND"
VLLM_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def env_spec() -> str | None:
    """The binding asked for in the environment: PAGEDLLM_CPU_BIND, else vLLM's variable."""
    spec = os.environ.get(ENV)
    if spec:
        return spec
    vllm = os.environ.get(VLLM_ENV, "").strip()
    if vllm.lower() == "nobind":
        return "all"
    return None if vllm.lower() in ("", "auto") else vllm


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,6' -> [0, 1, 2, 3, 6]."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.extend(range(int(lo), int(hi) + 1))
        elif part:
            cpus.append(int(part))
    return cpus


def rank_cpus(rank: int, size: int, spec: str | None = None, available: list[int] | None = None) -> list[int] | None:
    """The cores of ``rank`` (None: do not pin). ValueError naming a bad ``spec``."""
    spec = env_spec() if spec is None else spec
    if spec is not None and spec.strip().lower() == "all":
        return None
    if spec:
        parts = spec.split("|")
        if len(parts) != size:
            raise ValueError(
                f"{ENV}={spec!r} lists {len(parts)} core sets for tensor_parallel_size={size}; "
                f"give one per rank separated by '|', e.g. '0-3|4-7', or 'all'"
            )
        try:
            cpus = parse_cpu_list(parts[rank])
        except ValueError:
            raise ValueError(f"{ENV}={spec!r}: {parts[rank]!r} is not a core list such as '0-3' or '0,2'") from None
        if not cpus:
            raise ValueError(f"{ENV}={spec!r} gives rank {rank} no cores")
        return cpus
    available = sorted(os.sched_getaffinity(0)) if available is None else available
    if len(available) < size:
        return None  # fewer cores than ranks: share them all
    per_rank = len(available) // size
    return available[rank * per_rank : (rank + 1) * per_rank]


def placement_spec(size: int) -> str:
    """Every rank's cores as one PAGEDLLM_CPU_BIND string, fixed by the starting process
    before it pins itself (its workers inherit its affinity)."""
    spec = env_spec()
    if spec:
        return spec
    sets = [rank_cpus(rank, size, "") for rank in range(size)]
    if any(cpus is None for cpus in sets):
        return "all"
    return "|".join(",".join(map(str, cpus)) for cpus in sets)  # type: ignore[arg-type]


def bind_rank(rank: int, size: int, spec: str | None = None) -> list[int] | None:
    """Pin this process to its cores and use one torch thread per core; returns the cores."""
    import torch

    cpus = rank_cpus(rank, size, spec)
    if cpus is None:
        return None
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    logger.info("tensor-parallel rank %d/%d pinned to cores %s (%d threads)", rank, size, cpus, len(cpus))
    return cpus
