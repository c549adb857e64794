"""Where data-parallel replicas run: a launcher starts replica ``i``'s engine core and hands
back a ``StartedCore`` that ``CoreClient`` drives like the single core's.

- ``mp``: a local process per replica (``start_engine_core``), each pinned to its share of
  this machine's cores (``cpu_bind.rank_cpus``).
- ``ray``: a Ray actor per replica, on a placement group with one bundle per replica spread
  over the cluster's nodes (``SPREAD``; the first ``data_parallel_size_local`` bundles on this
  node); each runs the same engine-core loop
  (``run_engine_core``) connected over TCP to the front end's ``data_parallel_address``, with
  one torch thread per CPU of its bundle (a node started under ``taskset`` pins it to that
  node's cores). The actors are restartable (``max_restarts=-1``): when one dies, Ray starts it
  again and the next ``start(i)`` runs the core in the restarted actor. Ray is imported only here.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.core_client import StartedCore, start_engine_core

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0
RESTART_TIMEOUT_S = 120.0


class ReplicaLauncher(ABC):
    """Starts (and restarts) the engine core of replica ``index``."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.size = config.parallel_config.data_parallel_size

    @abstractmethod
    def start(self, index: int) -> StartedCore:
        """Start replica ``index``'s core (blocking: call it off the event loop)."""

    def describe(self, index: int) -> str:
        """Where replica ``index`` runs, for the log."""
        return ""

    def close(self) -> None:
        """Release what the launcher holds (after every replica's client shut down)."""


class MpReplicaLauncher(ReplicaLauncher):
    def start(self, index: int) -> StartedCore:
        from pagedllm.distributed.cpu_bind import rank_cpus

        cpus = rank_cpus(index, self.size, "")
        return start_engine_core(self.config, cpus, name=f"pagedllm-engine-core-dp{index}")

    def describe(self, index: int) -> str:
        from pagedllm.distributed.cpu_bind import rank_cpus

        cpus = rank_cpus(index, self.size, "")
        return "this machine, every core" if cpus is None else f"this machine, cores {cpus}"


class RayEngineCore:
    """The actor: runs one engine core's loop (its ``run`` call lasts the core's life)."""

    def __init__(self, num_cpus: int) -> None:
        self.num_cpus = num_cpus

    def where(self) -> tuple[int, str, list[int]]:
        """(pid, Ray node id, the cores this process may run on)."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id(), sorted(os.sched_getaffinity(0))

    def run(self, config: EngineConfig, input_addr: str, output_addr: str, log_level: int) -> None:
        import torch

        from pagedllm.engine.core_proc import run_engine_core

        torch.set_num_threads(self.num_cpus)
        run_engine_core(config, input_addr, output_addr, None, log_level)


class RayCoreHandle:
    """A Ray actor's core seen as ``CoreClient`` sees a process: ``sentinel`` (a pipe that turns
    readable when the actor's ``run`` call ends: the core stopped or the actor died),
    ``is_alive``, ``join``, ``exitcode``, ``terminate``/``kill`` (end the actor for good)."""

    def __init__(self, ray: Any, actor: Any, run_ref: Any, pid: int) -> None:
        self._ray, self._actor, self._run_ref = ray, actor, run_ref
        self.pid = pid
        self.exitcode: int | None = None
        self.error: str | None = None
        self._done = threading.Event()
        self._read_fd, self._write_fd = os.pipe()
        self.sentinel = self._read_fd
        threading.Thread(target=self._watch, name="pagedllm-dp-watch", daemon=True).start()

    def _watch(self) -> None:
        try:
            self._ray.get(self._run_ref)
            self.exitcode = 0
        except Exception as e:  # noqa: BLE001 -- RayActorError and kin: the actor died
            self.exitcode = 1
            self.error = type(e).__name__
        self._done.set()
        os.write(self._write_fd, b"x")

    def is_alive(self) -> bool:
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def terminate(self) -> None:
        self._ray.kill(self._actor, no_restart=True)

    kill = terminate


class RayReplicaLauncher(ReplicaLauncher):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        from pagedllm.distributed.ray_executor import _import_ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self._ray = _import_ray()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), logging_level=logging.WARNING)
        total_cpus = int(ray.cluster_resources().get("CPU", 0))
        self.cpus_per_replica = max(1, total_cpus // self.size)
        # The first data_parallel_size_local bundles on this node (Ray's node:<ip> resource).
        local = config.parallel_config.data_parallel_size_local
        local = 0 if local is None else local
        here = {f"node:{ray.util.get_node_ip_address()}": 0.001}
        bundles = [{"CPU": self.cpus_per_replica, **(here if i < local else {})} for i in range(self.size)]
        self._pg = placement_group(bundles, strategy="SPREAD")
        ready, _ = ray.wait([self._pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise ValueError(
                f"the Ray cluster has no room for {self.size} replica(s) of {self.cpus_per_replica} CPU(s) "
                f"each (resources: {ray.available_resources()}); add nodes or CPUs")
        import pagedllm

        # The actors import this very pagedllm (a checkout may shadow an installed one).
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(pagedllm.__file__)))
        actor_cls = ray.remote(RayEngineCore)
        self.actors = [
            actor_cls.options(
                num_cpus=self.cpus_per_replica, max_restarts=-1, max_concurrency=2,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i),
                runtime_env={"env_vars": {"PYTHONPATH": package_root,
                                          "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}},
            ).remote(self.cpus_per_replica)
            for i in range(self.size)
        ]
        self._where: dict[int, tuple[int, str, list[int]]] = {}

    def start(self, index: int) -> StartedCore:
        ray = self._ray
        actor = self.actors[index]
        pid, node_id, cpus = self._where[index] = self._where_when_up(actor)
        address = self.config.parallel_config.data_parallel_address
        input_addr = f"tcp://{address}:{_free_port(address)}"
        output_addr = f"tcp://{address}:{_free_port(address)}"
        run_ref = actor.run.remote(self.config, input_addr, output_addr, logging.getLogger().getEffectiveLevel())
        tmpdir = tempfile.mkdtemp(prefix="pagedllm-dp-")  # CoreClient removes it at shutdown
        return StartedCore(RayCoreHandle(ray, actor, run_ref, pid), tmpdir, input_addr, output_addr)

    def _where_when_up(self, actor: Any) -> tuple[int, str, list[int]]:
        """The actor's place, once it is up: a call to an actor Ray is restarting fails at once
        (ActorUnavailableError), so ask again until it answers."""
        ray = self._ray
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while True:
            try:
                return ray.get(actor.where.remote())
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def describe(self, index: int) -> str:
        pid, node_id, cpus = self._where.get(index, (0, "?", []))
        return f"Ray actor on node {node_id[:12]}, {self.cpus_per_replica} CPU(s) of cores {cpus}"

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 -- already gone
                pass
        remove_placement_group(self._pg)
        # Not ray.shutdown() here (a worker thread): Ray disconnects the driver at exit itself.


LAUNCHERS: dict[str, type[ReplicaLauncher]] = {"mp": MpReplicaLauncher, "ray": RayReplicaLauncher}


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]
