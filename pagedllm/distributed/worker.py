"""One tensor-parallel rank: its pinned cores, its share of the model, its model runner.

Every rank runs the same ModelRunner on the same SchedulerOutput: the collectives inside
the model (all-reduce after row-parallel layers, all-gather of the logits) keep the ranks in
step, and every rank samples the same tokens from the same gathered logits and seed, so the
per-request state each runner keeps (token ids, block tables) stays identical.
Rank 0 lives in the engine core; the executors (mp, ray) host ranks 1..N-1 in a `Worker`.
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass
from typing import Any, Callable

from pagedllm.config import DType
from pagedllm.distributed.cpu_bind import bind_rank
from pagedllm.distributed.parallel_state import TPGroup, tensor_parallel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelLoadSpec:
    """What every rank loads and runs: the same checkpoint, as rank 0 resolved it."""

    model: str
    """Model name, GGUF file or HF directory (LoadConfig.model)."""
    dtype: DType
    """Resolved by rank 0 (never "auto": every rank must load the same)."""
    max_model_len: int | None
    """None: the checkpoint's context length."""
    quantization: str | None
    """As LoadConfig.quantization (None: the loader's default for the file)."""
    seed: int
    """Seed of each rank's sampler (ranks sample the same tokens from the same logits)."""
    revision: str | None = None
    """A hub id's revision (LoadConfig.revision)."""
    download_dir: str | None = None
    """A hub id's cache (LoadConfig.download_dir); the workers start once rank 0 has built
    its model, so a download is done by then and they read the cache."""


@dataclass(frozen=True)
class WorkerSpec:
    load: ModelLoadSpec
    rank: int
    size: int
    cpu_bind: str | None
    """PAGEDLLM_CPU_BIND as rank 0 saw it (a Ray worker's environment may differ)."""


def load_rank_model(load: ModelLoadSpec, group: TPGroup, on_built: Callable[[], None] | None = None) -> Any:
    """This rank's shard of the model (a LoadedModel); see load_model for ``on_built``."""
    from pagedllm.models.loader import load_model

    with tensor_parallel(group):
        return load_model(
            load.model, dtype=load.dtype, max_model_len=load.max_model_len,
            quantization=load.quantization, on_built=on_built,
            revision=load.revision, download_dir=load.download_dir,
        )


class Worker:
    """Rank >= 1: load, join the process group, build the runner, then run steps."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.cpus = bind_rank(spec.rank, spec.size, spec.cpu_bind)
        self.group = TPGroup(spec.rank, spec.size)
        self.loaded = load_rank_model(spec.load, self.group)
        self.runner: Any = None

    def init_process_group(self, init_method: str) -> None:
        self.group.init_process_group(init_method)

    def build_runner(self, block_size: int, num_blocks: int) -> None:
        from pagedllm.worker.model_runner import ModelRunner

        self.runner = ModelRunner(
            self.loaded.model, self.loaded.model_config, block_size, num_blocks, seed=self.spec.load.seed
        )

    def execute(self, scheduler_output: bytes) -> None:
        """One step; rank 0 returns the output, so this one returns nothing."""
        self.runner.execute(pickle.loads(scheduler_output))

    def shutdown(self) -> None:
        self.group.destroy()
