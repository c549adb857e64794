"""Data parallelism: one front end over N engine-core replicas (``--data-parallel-size``).

``DPCoreClient`` has ``CoreClient``'s interface, so ``AsyncLLM`` (tokenizer, output processor,
metrics) runs unchanged over it. Each replica is a whole engine core driven by its own
``CoreClient``, started by a launcher (``dp_replicas.py``: local processes or Ray actors).

- Routing: each request (every sequence of an n > 1 request, each beam search) goes to the
  replica ``PrefixAffinityRouter`` picks from its prompt's block hashes and the replicas'
  loads (requests in flight there, KV usage from their stats). Aborts and pauses follow a
  request to its replica.
- Outputs: one reader task per replica puts its outputs on one queue; ``get_outputs`` takes
  from it. Stats are merged into totals (gauges summed over the live replicas, intervals
  passed on) for the engine's metrics; per-replica gauges go to ``EngineMetrics``' replica
  families.
- A replica that dies leaves the routing at once; its requests that got no output yet are
  sent to another replica, the others end with a 503 naming the replica. Then it is started
  again (Ray restarts its actor; ``mp`` spawns a new process) and rejoins once ready.
  ``get_outputs`` raises only when no replica can be started again.
- Utilities go to every live replica (``reset_prefix_cache``, LoRA adapters, ``kv_usage``
  summed), except the dashboard's ``kv_snapshot``, taken from the first live replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.engine.core_client import CoreClient, EngineDeadError
from pagedllm.engine.core_messages import CoreOutputs, CoreStats, ReadyInfo
from pagedllm.engine.dp_replicas import LAUNCHERS, ReplicaLauncher
from pagedllm.engine.dp_router import PrefixAffinityRouter, ReplicaLoad
from pagedllm.request import Request

if TYPE_CHECKING:
    from pagedllm.metrics import ReplicaMetrics

logger = logging.getLogger(__name__)

RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
"""Waits between failed restarts of a replica; after the last, the replica stays down."""


@dataclass(eq=False)
class Replica:
    index: int
    client: CoreClient | None = None
    up: bool = False
    num_total_blocks: int = 0
    stats: CoreStats | None = None
    """Its latest stats (None until the first, and while down)."""
    in_flight: set[str] = field(default_factory=set)
    """Core request ids sent there and not finished."""
    reader: asyncio.Task | None = None
    num_routed: int = 0


class DPCoreClient:
    def __init__(self, config: EngineConfig, metrics: ReplicaMetrics | None = None) -> None:
        self.config = config
        self.size = config.parallel_config.data_parallel_size
        self.metrics = metrics  # the per-replica series
        self._router = PrefixAffinityRouter(config.cache_config.block_size)
        self._replicas = [Replica(i) for i in range(self.size)]
        self._owner: dict[str, int] = {}  # core request id -> replica index
        # Sent, no output yet (may go to another replica if its own dies): (kind, payload, hashes).
        self._unstarted: dict[str, tuple[str, Any, list[int]]] = {}
        self._queue: asyncio.Queue[CoreOutputs | BaseException] = asyncio.Queue()
        self._launcher: ReplicaLauncher | None = None
        self._closed = False
        self._loop = asyncio.get_running_loop()

    # ---- start-up and restarts ---------------------------------------------------------

    async def wait_ready(self) -> ReadyInfo:
        backend = self.config.parallel_config.data_parallel_backend
        self._launcher = await self._loop.run_in_executor(None, LAUNCHERS[backend], self.config)
        infos = await asyncio.gather(*(self._start_replica(r) for r in self._replicas))
        logger.info("data parallelism: %d replicas (%s backend) ready", self.size, backend)
        return infos[0]

    async def _start_replica(self, replica: Replica) -> ReadyInfo:
        assert self._launcher is not None
        started = await self._loop.run_in_executor(None, self._launcher.start, replica.index)
        client = CoreClient(self.config, started)
        replica.client = client
        info = await client.wait_ready()
        replica.num_total_blocks = info.num_total_blocks
        self._router.add_replica(replica.index, info.num_total_blocks)
        replica.up = True
        replica.reader = self._loop.create_task(self._read(replica))
        logger.info("data-parallel replica %d up: pid %d (%s)", replica.index, started.proc.pid,
                    self._launcher.describe(replica.index))
        self._set_up(replica)
        return info

    async def _read(self, replica: Replica) -> None:
        client = replica.client
        assert client is not None
        try:
            while True:
                self._on_outputs(replica, await client.get_outputs())
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 -- EngineDeadError, or a broken message: the same end
            if self._closed:
                return
            self._on_death(replica, e)
        await self._restart(replica)

    async def _restart(self, replica: Replica) -> None:
        old, replica.client = replica.client, None
        if old is not None:
            await self._loop.run_in_executor(None, old.shutdown, 2.0)
        for attempt, backoff in enumerate(RESTART_BACKOFF_S):
            if self._closed:
                return
            try:
                await self._start_replica(replica)
            except Exception as e:  # noqa: BLE001 -- try again after a while
                logger.error("data-parallel replica %d did not start again (attempt %d): %s",
                             replica.index, attempt + 1, e)
                if replica.client is not None:
                    await self._loop.run_in_executor(None, replica.client.shutdown, 2.0)
                    replica.client = None
                await asyncio.sleep(backoff)
                continue
            if self.metrics is not None:
                self.metrics.observe_replica_restart(replica.index)
            if self._closed:
                await self._loop.run_in_executor(None, replica.client.shutdown, 2.0)
            return
        logger.error("data-parallel replica %d stays down", replica.index)
        if not any(r.up for r in self._replicas) and not self._closed:
            self._queue.put_nowait(EngineDeadError(f"every data-parallel replica is down (the last: "
                                                   f"replica {replica.index} did not start again)"))

    def _on_death(self, replica: Replica, error: BaseException) -> None:
        """Take a dead replica out of the routing; retry its requests that got no output
        yet, fail the rest (a 503 naming the replica)."""
        replica.up = False
        replica.stats = None
        self._router.remove_replica(replica.index)
        self._set_up(replica)
        in_flight = list(replica.in_flight)
        replica.in_flight.clear()
        logger.error("data-parallel replica %d died (%s); %d request(s) were on it", replica.index, error,
                     len(in_flight))
        failed: list[EngineCoreOutput] = []
        num_retried = 0
        for request_id in in_flight:
            self._owner.pop(request_id, None)
            entry = self._unstarted.pop(request_id, None)
            if entry is not None:
                try:
                    self._dispatch(request_id, *entry)
                    num_retried += 1
                    continue
                except EngineDeadError:
                    pass
            failed.append(EngineCoreOutput(
                request_id, [], "abort", None, 0, retryable=True,
                error=f"data-parallel replica {replica.index} died while serving the request ({error}); retry it"))
        if self.metrics is not None:
            self.metrics.observe_replica_death(replica.index, num_retried, len(failed))
        if num_retried:
            logger.warning("%d request(s) without output yet sent to other replicas", num_retried)
        if failed:
            self._queue.put_nowait(CoreOutputs(failed))

    def _set_up(self, replica: Replica) -> None:
        if self.metrics is not None:
            self.metrics.record_replica(replica.index, replica.up, replica.stats, len(replica.in_flight))

    # ---- front end -> cores ------------------------------------------------------------

    def _loads(self) -> dict[int, ReplicaLoad]:
        return {
            r.index: ReplicaLoad(len(r.in_flight),
                                 r.stats.scheduler_stats.kv_cache_usage if r.stats is not None else 0.0,
                                 r.num_routed)
            for r in self._replicas if r.up
        }

    def _dispatch(self, request_id: str, kind: str, payload: Any, hashes: list[int]) -> None:
        loads = self._loads()
        while True:
            if self._closed or not loads:
                raise EngineDeadError(f"no data-parallel replica is up ({self.size} restarting)")
            index = self._router.choose(hashes, loads)
            replica = self._replicas[index]
            assert replica.client is not None
            try:
                if kind == "add":
                    replica.client.add_request(payload)
                else:
                    replica.client.add_beam_search(*payload)
                break
            except EngineDeadError:  # it died; its reader has not handled that yet: try another
                del loads[index]
        self._router.record(index, hashes)
        self._owner[request_id] = index
        self._unstarted[request_id] = (kind, payload, hashes)
        replica.in_flight.add(request_id)
        replica.num_routed += 1
        if self.metrics is not None:
            self.metrics.observe_routed(index)

    def add_request(self, request: Request) -> None:
        hashes = self._router.block_hashes(request.prompt_token_ids)
        self._dispatch(request.request_id, "add", request, hashes)

    def add_beam_search(self, request_id: str, prompt_token_ids: list[int], params: Any) -> None:
        hashes = self._router.block_hashes(prompt_token_ids)
        self._dispatch(request_id, "add_beam_search", (request_id, prompt_token_ids, params), hashes)

    def _by_replica(self, request_ids: list[str], forget: bool) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = defaultdict(list)
        for request_id in request_ids:
            index = self._owner.pop(request_id, None) if forget else self._owner.get(request_id)
            if index is None:
                continue
            if forget:
                self._unstarted.pop(request_id, None)
                self._replicas[index].in_flight.discard(request_id)
            groups[index].append(request_id)
        return groups

    def abort_requests(self, request_ids: list[str], stopped: bool = False) -> None:
        for index, ids in self._by_replica(request_ids, forget=True).items():
            client = self._replicas[index].client
            if client is not None:
                client.abort_requests(ids, stopped)

    def pause_requests(self, request_ids: list[str], pause: bool = True) -> None:
        for index, ids in self._by_replica(request_ids, forget=False).items():
            client = self._replicas[index].client
            if client is not None:
                client.pause_requests(ids, pause)

    async def call_utility(self, name: str, payload: Any = None) -> Any:
        live = [r for r in self._replicas if r.up and r.client is not None]
        if not live:
            raise EngineDeadError("no data-parallel replica is up")
        if name == "kv_snapshot":  # the dashboard's: one replica's pool
            return await live[0].client.call_utility(name, payload)  # type: ignore[union-attr]
        results = await asyncio.gather(*(r.client.call_utility(name, payload) for r in live))  # type: ignore[union-attr]
        if name == "reset_prefix_cache":
            for r in live:
                self._router.add_replica(r.index, r.num_total_blocks)
            return all(results)
        if name == "add_lora":  # None when every replica took it, else the first refusal
            return next((refusal for refusal in results if refusal is not None), None)
        if name == "remove_lora":
            return any(results)
        if name == "kv_usage":
            total = {key: sum(result[key] for result in results) for key in results[0]}
            total["kv_cache_usage"] = total["kv_cache_usage"] / len(results)
            return total
        return results[0]

    def replica_states(self) -> list[dict[str, Any]]:
        """Each replica's figures for the dashboard."""
        states = []
        for r in self._replicas:
            s = r.stats.scheduler_stats if r.stats is not None else None
            states.append({"replica": r.index, "up": r.up, "in_flight": len(r.in_flight),
                           "running": s.num_running if s else 0, "waiting": s.num_waiting if s else 0,
                           "kv_cache_usage": s.kv_cache_usage if s else 0.0, "routed": r.num_routed})
        return states

    # ---- cores -> front end ------------------------------------------------------------

    async def get_outputs(self) -> CoreOutputs:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def _on_outputs(self, replica: Replica, outputs: CoreOutputs) -> None:
        for eo in outputs.outputs:
            self._unstarted.pop(eo.request_id, None)
            if eo.finished and self._owner.get(eo.request_id) == replica.index:
                del self._owner[eo.request_id]
                replica.in_flight.discard(eo.request_id)
        stats = None
        if outputs.stats is not None:
            replica.stats = outputs.stats
            stats = self._merged_stats(outputs.stats)
            self._set_up(replica)
        self._queue.put_nowait(CoreOutputs(outputs.outputs, stats))

    def _merged_stats(self, latest: CoreStats) -> CoreStats:
        """Totals over the live replicas' latest stats (gauges); the intervals (prefix-cache
        lookups, queue times, step sizes, drafts) are ``latest``'s own."""
        live = [r.stats for r in self._replicas if r.up and r.stats is not None]
        total_blocks = sum(s.num_total_blocks for s in live)
        sched = [s.scheduler_stats for s in live]
        usage = sum(s.scheduler_stats.kv_cache_usage * s.num_total_blocks for s in live) / max(1, total_blocks)
        merged = dataclasses.replace(
            latest.scheduler_stats, num_running=sum(s.num_running for s in sched),
            num_waiting=sum(s.num_waiting for s in sched), num_paused=sum(s.num_paused for s in sched),
            kv_cache_usage=usage, num_preemptions=sum(s.num_preemptions for s in sched),
            kv_resident_bytes=sum(s.kv_resident_bytes for s in sched),
            kv_token_bytes=sum(s.kv_token_bytes for s in sched))
        return CoreStats(merged, sum(s.num_free_blocks for s in live), total_blocks, latest.queue_times,
                         None, latest.iteration_tokens)

    # ---- shutdown ----------------------------------------------------------------------

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop every replica and the launcher (runs in an executor thread)."""
        if self._closed:
            return
        self._closed = True
        for replica in self._replicas:
            if replica.reader is not None:
                self._loop.call_soon_threadsafe(replica.reader.cancel)
        for replica in self._replicas:
            if replica.client is not None:
                replica.client.shutdown(timeout_s)
        if self._launcher is not None:
            self._launcher.close()
