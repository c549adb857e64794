"""The ``ray`` executor: ranks 1..N-1 as Ray actors on a cluster the user started.

Rank 0 stays in the engine core (the Ray driver). The driver joins the running cluster
(``RAY_ADDRESS``, default ``auto``: the cluster ``ray start`` made on this machine), reserves
one CPU bundle per worker rank in a placement group (``PACK``: on as few machines as fit),
and starts one actor per bundle. The gloo group meets at the driver's node address.
Each step the driver calls ``execute`` on every actor, runs rank 0's step, then collects
the actors' results (which surfaces a dead actor). Ray is imported only here.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from pagedllm.distributed.executor import DistributedExecutor
from pagedllm.distributed.worker import Worker, WorkerSpec

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError(
            "distributed_executor_backend='ray' needs Ray: pip install 'pagedllm[ray]' "
            "(ray==2.60.0), then start a cluster with `ray start --head`"
        ) from None
    return ray


class RayWorker:
    """The actor: one rank. A failed step exits the actor's process, so rank 0's collective
    breaks at once instead of waiting for a peer that will never come."""

    def __init__(self, spec: WorkerSpec) -> None:
        logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank{spec.rank} %(name)s: %(message)s")
        self.worker = Worker(spec)

    def pid(self) -> int:
        return os.getpid()

    def init_process_group(self, init_method: str) -> None:
        self.worker.init_process_group(init_method)

    def build_runner(self, block_size: int, num_blocks: int) -> None:
        self.worker.build_runner(block_size, num_blocks)

    def execute(self, scheduler_output: bytes) -> None:
        try:
            self.worker.execute(scheduler_output)
        except BaseException:
            logger.exception("tensor-parallel step failed; the actor exits")
            os._exit(1)

    def shutdown(self) -> None:
        self.worker.shutdown()


class RayExecutor(DistributedExecutor):
    backend = "ray"

    def _launch_workers(self) -> None:
        ray = _import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), logging_level=logging.WARNING)
        num_workers = self.size - 1
        self._pg = placement_group([{"CPU": 1}] * num_workers, strategy="PACK")
        ready, _ = ray.wait([self._pg.ready()], timeout=60)
        if not ready:
            raise ValueError(
                f"the Ray cluster has no room for {num_workers} worker(s) of 1 CPU each "
                f"(resources: {ray.available_resources()}); add nodes or CPUs"
            )
        actor_cls = ray.remote(num_cpus=1)(RayWorker)
        self.actors = [
            actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i)
            ).remote(self.worker_spec(i + 1))
            for i in range(num_workers)
        ]

    def _start_workers(self, block_size: int, num_blocks: int) -> None:
        ray = self._ray
        self.pids = ray.get([a.pid.remote() for a in self.actors], timeout=START_TIMEOUT_S)
        address = ray.util.get_node_ip_address()
        init_method = f"tcp://{address}:{_free_port(address)}"
        joined = [a.init_process_group.remote(init_method) for a in self.actors]
        self.group.init_process_group(init_method)
        ray.get(joined)
        ray.get([a.build_runner.remote(block_size, num_blocks) for a in self.actors])
        self._step_refs: list[Any] = []

    def _broadcast(self, data: bytes) -> None:
        self._step_refs = [a.execute.remote(data) for a in self.actors]

    def _finish_step(self) -> None:
        refs, self._step_refs = self._step_refs, []
        try:
            self._ray.get(refs)
        except self._ray.exceptions.RayError as e:
            raise RuntimeError(f"gloo peer lost: {e}") from e

    def _dead_workers(self) -> list[str]:
        ray = self._ray
        dead = []
        for rank, (actor, pid) in enumerate(zip(self.actors, self.pids), start=1):
            try:
                ray.get(actor.pid.remote(), timeout=5)
            except ray.exceptions.RayError as e:
                dead.append(f"rank {rank} (pid {pid}, Ray actor) died ({type(e).__name__})")
        return dead

    def _stop_workers(self) -> None:
        ray = getattr(self, "_ray", None)
        if ray is None:
            return
        for actor in getattr(self, "actors", []):
            ray.kill(actor)
        if getattr(self, "_pg", None) is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
        if self._owns_ray:
            ray.shutdown()


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]

