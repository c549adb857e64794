"""One tensor-parallel rank: its pinned cores, its share of the model, its model runner.

Every rank runs the same ModelRunner on the same SchedulerOutput: the collectives inside
the model (all-reduce after row-parallel layers, all-gather of the logits) keep the ranks in
step, and every rank samples the same tokens from the same gathered logits and seed, so the
per-request state each runner keeps (token ids, block tables) stays identical.
Rank 0 lives in the engine core; the executors (mp, ray) host ranks 1..N-1 in a `Worker`.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from dataclasses import dataclass
from typing import Any, Callable

from pagedllm.distributed.cpu_bind import bind_rank
from pagedllm.distributed.parallel_state import TPGroup, tensor_parallel
from pagedllm.engine.arg_utils import EngineArgs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    args: EngineArgs
    """The engine's arguments, dtype resolved by rank 0 (every rank loads the same)."""
    rank: int
    size: int
    cpu_bind: str | None
    """PAGEDLLM_CPU_BIND as rank 0 saw it (a Ray worker's environment may differ)."""


def load_rank_model(args: EngineArgs, group: TPGroup, on_built: Callable[[], None] | None = None) -> Any:
    """This rank's shard of the model (a LoadedModel); see load_model for ``on_built``."""
    from pagedllm.models.loader import load_model

    with tensor_parallel(group):
        return load_model(
            args.model, dtype=args.resolve_dtype(), max_model_len=args.max_model_len,
            quantization=args.quantization, on_built=on_built,
        )


def resolved_args(args: EngineArgs) -> EngineArgs:
    return dataclasses.replace(args, dtype=args.resolve_dtype())


class Worker:
    """Rank >= 1: load, join the process group, build the runner, then run steps."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.cpus = bind_rank(spec.rank, spec.size, spec.cpu_bind)
        self.group = TPGroup(spec.rank, spec.size)
        self.loaded = load_rank_model(spec.args, self.group)
        self.runner: Any = None

    def init_process_group(self, init_method: str) -> None:
        self.group.init_process_group(init_method)

    def build_runner(self, block_size: int, num_blocks: int) -> None:
        from pagedllm.worker.model_runner import ModelRunner

        self.runner = ModelRunner(
            self.loaded.model, self.loaded.model_config, block_size, num_blocks, seed=self.spec.args.seed
        )

    def execute(self, scheduler_output: bytes) -> None:
        """One step; rank 0 returns the output, so this one returns nothing."""
        self.runner.execute(pickle.loads(scheduler_output))

    def shutdown(self) -> None:
        self.group.destroy()
