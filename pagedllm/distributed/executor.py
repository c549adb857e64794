"""Executors: run each SchedulerOutput on every tensor-parallel rank.

The engine core calls `execute(scheduler_output)` on its runner; with one rank (``uni``) that
runner is the ModelRunner itself, in process, exactly as without this module. With N ranks
the executor stands in its place: rank 0 runs in the engine core (so the scheduler runs once,
there), ranks 1..N-1 in workers that the executor starts — processes on this machine (``mp``,
mp_executor.py) or Ray actors (``ray``, ray_executor.py), chosen by ParallelConfig
(executors.py). Each step the executor broadcasts the pickled SchedulerOutput to the
workers, runs rank 0's step and returns its output.

A worker that dies fails the engine: the collective rank 0 waits in breaks at once (gloo
reports the closed connection), the executor stops the other workers and raises
`WorkerDiedError`, naming the rank, its pid and how it ended.
"""

from __future__ import annotations

import abc
import logging
import os
import pickle
from typing import Any

from pagedllm.config import ParallelConfig
from pagedllm.distributed.cpu_bind import bind_rank, env_spec, placement_spec
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.distributed.worker import ModelLoadSpec, WorkerSpec, load_rank_model

logger = logging.getLogger(__name__)


class ExecutorFailedError(BaseException):
    """The ranks can no longer step together: the engine stops.

    A BaseException (as SystemExit), not an Exception: the engine-core loop fails a batch on
    an Exception and goes on, which a missing or out-of-step rank makes impossible; this ends
    the engine (the server's core process exits non-zero, the front end answers 503 and exits).
    """


class WorkerDiedError(ExecutorFailedError):
    """A tensor-parallel worker died."""


class DistributedExecutor(abc.ABC):
    """Rank 0 in this process, ranks 1..N-1 in workers (the subclass hosts them)."""

    backend: str

    def __init__(self, config: ParallelConfig, load: ModelLoadSpec) -> None:
        assert load.dtype in ("float32", "bfloat16"), f"dtype {load.dtype!r} must be resolved by rank 0"
        self.size = config.tensor_parallel_size
        self.load = load
        self.group = TPGroup(0, self.size)
        self.runner: Any = None
        self._saved_placement: tuple[set[int], int] | None = None
        # mp: every rank's cores fixed here (workers inherit rank 0's pinned affinity);
        # ray: each actor splits its own machine unless PAGEDLLM_CPU_BIND says otherwise.
        self._cpu_bind = placement_spec(self.size) if self.backend == "mp" else env_spec()
        self._closed = False

    def load_model(self) -> Any:
        """Rank 0's shard of the model (a LoadedModel). Once rank 0's model is built and
        checked (head counts, quantization), the workers launch and load their shards while
        rank 0 loads its weights; a failure stops them."""
        self._saved_placement = _current_placement()
        try:
            bind_rank(0, self.size, self._cpu_bind)
            return load_rank_model(self.load, self.group, on_built=self._launch_workers)
        except BaseException:
            self.shutdown()
            raise

    def worker_spec(self, rank: int) -> WorkerSpec:
        return WorkerSpec(self.load, rank, self.size, self._cpu_bind)

    def start(self, runner: Any, block_size: int, num_blocks: int) -> DistributedExecutor:
        """Once the workers have loaded: join the process group, have every worker build its
        runner for the same KV pool; returns self, which the engine core uses as its runner."""
        self.runner = runner
        try:
            self._start_workers(block_size, num_blocks)
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "tensor parallel: %d ranks (%s executor), rank 0 in process %d", self.size, self.backend, os.getpid()
        )
        return self

    @property
    def eos_token_ids(self) -> list[int]:
        return self.runner.eos_token_ids

    @property
    def model(self) -> Any:
        return self.runner.model

    @property
    def kv_caches(self) -> Any:
        return self.runner.kv_caches

    def execute(self, scheduler_output: Any) -> Any:
        if self._closed:
            raise ExecutorFailedError("the tensor-parallel executor is shut down")
        data = pickle.dumps(scheduler_output, protocol=5)
        try:
            self._broadcast(data)
            output = self.runner.execute(scheduler_output)
            self._finish_step()
        except Exception as e:
            # A lost worker breaks the collective (or the pipe) at once. Any other failure of
            # rank 0's step may leave the workers inside a collective it never reached: the
            # ranks are out of step either way.
            dead = self._dead_workers()
            self.shutdown()
            if dead:
                raise WorkerDiedError(
                    f"tensor-parallel worker lost: {'; '.join(dead)}. The engine cannot continue "
                    "without every rank; restart it"
                ) from e
            raise ExecutorFailedError(
                f"tensor-parallel step failed on rank 0 ({type(e).__name__}: {e}); the ranks may "
                "be out of step, so the engine stops; restart it"
            ) from e
        return output

    def shutdown(self) -> None:
        """Stop the workers and leave the process group; restore rank 0's thread placement."""
        if self._closed:
            return
        self._closed = True
        try:
            self._stop_workers()
        finally:
            self.group.destroy()
            if self._saved_placement is not None:
                _restore_placement(self._saved_placement)

    @abc.abstractmethod
    def _launch_workers(self) -> None:
        """Start ranks 1..N-1 loading their shards (without waiting for them)."""

    @abc.abstractmethod
    def _start_workers(self, block_size: int, num_blocks: int) -> None:
        """Wait for the workers' shards, join the process group, build their runners."""

    @abc.abstractmethod
    def _broadcast(self, data: bytes) -> None:
        """Hand this step's pickled SchedulerOutput to every worker."""

    def _finish_step(self) -> None:
        """After rank 0's step (ray: collect the workers' results)."""

    @abc.abstractmethod
    def _dead_workers(self) -> list[str]:
        """Descriptions of workers that are gone ("rank 1 (pid 123) killed by SIGKILL")."""

    @abc.abstractmethod
    def _stop_workers(self) -> None: ...


def _current_placement() -> tuple[set[int], int]:
    import torch

    return os.sched_getaffinity(0), torch.get_num_threads()


def _restore_placement(placement: tuple[set[int], int]) -> None:
    import torch

    cpus, threads = placement
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)
