"""The engine-core process behind the server: a busy loop of scheduler + model runner.

The front end (``core_client.py``) and this process talk over two ZMQ sockets; the
messages are in ``core_messages.py``.

The loop drains the input socket, steps while any request is unfinished, and blocks on the
socket when idle, waking every ``IDLE_STATS_INTERVAL_S`` to send stats, so gauges stay current.
The process dies with its parent: PR_SET_PDEATHSIG on Linux, and a parent-pid check.

A message that raises fails its sender alone: a request whose add raises is failed (the front
end answers 500), a utility that raises answers its caller with the error; the loop goes on.
A step that raises does not end the process: the requests of the failed batch (those running)
are aborted with an ``error`` (the front end fails them), their blocks freed and the prefix
cache dropped (blocks cached for the failed step may hold no KV); waiting and new requests go on.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from pagedllm import faults
from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.config import EngineConfig
from pagedllm.engine.core_messages import CoreOutputs, CoreStats, ReadyInfo, dumps, loads
from pagedllm.engine.kv_snapshot import take_kv_snapshot
from pagedllm.process_utils import die_with_parent
from pagedllm.request import Request, RequestStatus
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_STATS_INTERVAL_S = 0.5
BUSY_STATS_INTERVAL_S = 0.25
KV_POLL_INTERVAL_S = 0.02


def run_engine_core(
    config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int | None, log_level: int,
    cpus: list[int] | None = None,
) -> None:
    """Entry point of the core process (spawned by the front end). ``parent_pid`` None: the
    process is not the front end's child (a Ray actor, which Ray ends with its driver).
    ``cpus``: pin the process to these cores, one torch thread each (a data-parallel replica)."""
    if parent_pid is not None:
        die_with_parent(parent_pid)
    if cpus:
        import torch

        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(len(cpus))
    # Ctrl-C reaches the whole process group: the front end decides when the core stops.
    _set_signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    import zmq

    ctx = zmq.Context()
    in_sock = ctx.socket(zmq.PULL)
    in_sock.connect(input_addr)
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.connect(output_addr)
    try:
        proc = EngineCoreProc(config, in_sock, out_sock, parent_pid)
    except Exception as e:  # start-up failed: say why, then exit
        logger.exception("engine core failed to start")
        out_sock.send(dumps("failed", f"{type(e).__name__}: {e}"))
        # `pagedllm serve` spawns the core before binding its sockets: wait for it to bind (the
        # core dies with its parent, so this never outlives a front end that is gone).
        out_sock.close(linger=60_000)
        in_sock.close(linger=0)  # ctx.term() waits for every socket to close
        ctx.term()
        raise SystemExit(1) from e
    _set_signal(signal.SIGTERM, lambda *_: proc.request_stop())
    exit_code = 0
    try:
        proc.run()
    except BaseException:  # a bug in the loop: exit at once, so the front end sees it (503s)
        logger.exception("engine core failed; exiting")
        exit_code = 1
    try:
        proc.core.shutdown()
    except Exception:
        logger.exception("engine core shutdown failed")
    in_sock.close(linger=0)
    out_sock.close(linger=1000)
    ctx.term()
    if parent_pid is None:  # a Ray actor: its call returns (or fails), the actor lives on
        if exit_code:
            raise RuntimeError("the engine core failed; see its log")
        return
    # Skip the interpreter's teardown of torch and its thread pools: on a loaded machine it
    # takes longer than the front end waits before terminating the process, and after a
    # failure it could hang with the process still alive (the front end would not notice).
    logging.shutdown()
    os._exit(exit_code)


def _set_signal(signum: int, handler: Any) -> None:
    """Install a signal handler where this is the main thread (a Ray actor's call may not be)."""
    try:
        signal.signal(signum, handler)
    except ValueError:
        logger.debug("not the main thread: signal %d left as it is", signum)


class EngineCoreProc:
    def __init__(self, config: EngineConfig, in_sock: Any, out_sock: Any, parent_pid: int | None) -> None:
        import zmq

        from pagedllm.engine.core_builder import build_engine_core

        self._zmq = zmq
        built = build_engine_core(config)
        self.core = built.engine_core
        self.scheduler = built.scheduler
        self.kv = built.scheduler.kv_cache_manager
        self.num_total_blocks = built.config.num_blocks - 1
        self.in_sock = in_sock
        self.out_sock = out_sock
        self.parent_pid = parent_pid
        self.model_config = built.model_config
        self._stop = False
        self._unscheduled: dict[str, Request] = {}  # added, not yet scheduled: for queue time
        self._queue_times: list[float] = []
        # Scheduled, first output not yet sent: the step start that first scheduled each.
        self._scheduled_at: dict[str, float] = {}
        self._iteration_tokens: list[int] = []  # tokens per step since the last stats
        # Dashboard: durations of recent steps; seconds and calls per utility (a snapshot's cost).
        self._step_seconds: deque[float] = deque(maxlen=32)
        self._utility_seconds: dict[str, float] = {}
        self._utility_calls: dict[str, int] = {}
        self._handlers: dict[str, Callable[[Any], None]] = {
            "add": self._add, "add_beam_search": self._add_beam_search, "abort": self._abort,
            "pause": self.scheduler.pause_requests, "resume": self.scheduler.resume_requests,
            "shutdown": self._shutdown,
        }
        # Utilities: name -> a call whose result goes back to the caller.
        self._utilities: dict[str, Callable[[], Any]] = {
            "reset_prefix_cache": self.kv.reset_prefix_cache, "kv_snapshot": self._kv_snapshot,
            "add_lora": self._add_lora, "remove_lora": self._remove_lora, "kv_usage": self._kv_usage,
            "kv_save": self._kv_save, "kv_restore": self._kv_restore,
        }
        self._warm_up()
        info = ReadyInfo(built.model_config, built.config, built.tokenizer, self.num_total_blocks,
                         built.generation_defaults)
        out_sock.send(dumps("ready", info))

    def _warm_up(self) -> None:
        """One short request before reporting ready: the first steps pay one-time kernel
        set-up costs that would otherwise land on the first client."""
        t0 = time.monotonic()
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        if self.model_config.runner == "pooling":  # a model that only pools: a pooling request
            self.core.add_request(Request("pagedllm-warmup", [1] * 32, params, max_tokens=1,
                                          pooling_params=PoolingParams()))
        else:
            self.core.add_request(Request("pagedllm-warmup", [1] * 32, params))
        while self._has_work():
            self.core.step()
        self.core.get_stats()  # drop the warm-up's prefix-cache lookups from the stats
        logger.info("warm-up done in %.2f s", time.monotonic() - t0)

    def request_stop(self) -> None:
        self._stop = True

    def _has_work(self) -> bool:
        return self.core.has_unfinished_requests() or self.scheduler.has_finished_requests()

    def run(self) -> None:
        poller = self._zmq.Poller()
        poller.register(self.in_sock, self._zmq.POLLIN)
        next_stats = 0.0
        was_busy = False
        while not self._stop:
            busy = self._has_work()
            # Blocks held for a remote pull: poll the KV connector often, without spinning.
            kv_pending = self.scheduler.has_pending_kv_transfers()
            idle_s = KV_POLL_INTERVAL_S if kv_pending else IDLE_STATS_INTERVAL_S
            timeout_ms = 0 if busy else int(idle_s * 1000)
            if poller.poll(timeout_ms):
                self._drain_input()
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                logger.warning("front end process is gone; engine core exits")
                return
            outputs = []
            step_start = time.monotonic()
            if self._has_work() or kv_pending:
                t0 = time.perf_counter()
                outputs = self._step()
                self._step_seconds.append(time.perf_counter() - t0)
                if self.core.last_num_scheduled_tokens:
                    self._iteration_tokens.append(self.core.last_num_scheduled_tokens)
            self._note_scheduled(step_start)
            self._stamp_scheduled(outputs)
            now = time.monotonic()
            busy = self._has_work()
            stats = None
            if now >= next_stats or (was_busy and not busy):
                stats = self._make_stats()
                next_stats = now + (BUSY_STATS_INTERVAL_S if busy else IDLE_STATS_INTERVAL_S)
            was_busy = busy
            if outputs or stats is not None:
                self.out_sock.send(dumps("outputs", CoreOutputs(outputs, stats)))
        logger.info("engine core stopped")

    def _step(self) -> list[EngineCoreOutput]:
        try:
            for request in self.scheduler.running:
                faults.maybe_raise("core_step", request.request_id)
            return self.core.step()
        except Exception as e:  # noqa: BLE001 -- fail the batch, keep serving
            return self._fail_running(e)

    def _fail_running(self, error: Exception) -> list[EngineCoreOutput]:
        logger.exception("engine step failed; failing the %d running requests", len(self.scheduler.running))
        running = [r.request_id for r in self.scheduler.running]
        # A beam fails its whole search.
        request_ids = list(dict.fromkeys(self.core.beam_search.search_id_of(r) or r for r in running))
        self.core.abort_requests(request_ids)
        if not self.scheduler.running and not self.kv.reset_prefix_cache():
            logger.warning("could not drop the prefix cache after a failed step")
        message = f"{type(error).__name__}: {error}"
        return [EngineCoreOutput(r, [], "abort", None, 0, error=message) for r in request_ids]

    def _drain_input(self) -> None:
        zmq = self._zmq
        while True:
            try:
                kind, payload = loads(self.in_sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            self._handle(kind, payload)

    def _handle(self, kind: str, payload: Any) -> None:
        """Handle one message; one that raises fails its sender alone (a request's add: that
        request; a utility: its caller), never the loop."""
        if kind in self._utilities:
            self._run_utility(kind, payload)
            return
        handler = self._handlers.get(kind)
        if handler is None:
            logger.error("unknown message kind %r", kind)
            return
        try:
            handler(payload)
        except Exception:  # noqa: BLE001 -- an abort or shutdown has no caller to tell
            logger.exception("handling a %r message failed", kind)

    def _add(self, request: Request) -> None:
        try:
            faults.maybe_raise("add", request.request_id)
            self.core.add_request(request)
        except Exception as e:  # noqa: BLE001 -- validated in the front end; still fail it alone
            self._reject(request.request_id, e)
            return
        self._unscheduled[request.request_id] = request

    def _add_beam_search(self, payload: tuple[str, list[int], Any]) -> None:
        request_id, prompt_token_ids, params = payload
        try:
            faults.maybe_raise("add", request_id)
            self.core.add_beam_search(request_id, prompt_token_ids, params)
        except Exception as e:  # noqa: BLE001
            self._reject(request_id, e)

    def _reject(self, request_id: str, error: Exception) -> None:
        """Fail a request whose add raised: drop what of it got in, tell the front end (a 500)."""
        logger.error("could not add request %s: %s: %s", request_id, type(error).__name__, error)
        try:
            self.core.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        except Exception:  # noqa: BLE001 -- it may not have got in at all
            logger.exception("cleaning up request %s after a failed add", request_id)
        from pagedllm.lora.checkpoint import LoRAAdapterError

        # A refused LoRA adapter is the request's own fault (a 400), anything else a 500.
        out = EngineCoreOutput(request_id, [], "abort", None, 0, error=f"{type(error).__name__}: {error}",
                               invalid=isinstance(error, LoRAAdapterError))
        self.out_sock.send(dumps("outputs", CoreOutputs([out])))

    def _abort(self, payload: tuple[list[str], bool]) -> None:
        request_ids, stopped = payload
        status = RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_ABORTED
        for request_id in request_ids:
            self._unscheduled.pop(request_id, None)
            self._scheduled_at.pop(request_id, None)
        self.core.finish_requests(request_ids, status)

    def _shutdown(self, _: Any) -> None:
        self._stop = True

    def _run_utility(self, name: str, payload: Any = None) -> None:
        """Run a utility (with its payload, if any) and send ("utility", (name, result,
        error)): error is None or the exception's "Type: message" (the front end fails the
        caller with it)."""
        t0 = time.perf_counter()
        try:
            faults.maybe_raise("utility", name)
            args = () if payload is None else (payload,)
            message = dumps("utility", (name, self._utilities[name](*args), None))  # pickling may raise too
        except Exception as e:  # noqa: BLE001 -- fail the caller, keep serving
            logger.exception("utility %s failed", name)
            message = dumps("utility", (name, None, f"{type(e).__name__}: {e}"))
        self.out_sock.send(message)
        self._utility_seconds[name] = self._utility_seconds.get(name, 0.0) + time.perf_counter() - t0
        self._utility_calls[name] = self._utility_calls.get(name, 0) + 1

    def _add_lora(self, request: Any) -> str | None:
        """Load and check a LoRA adapter against the model (between steps): None when it
        is loaded, else why it is refused (the front end answers a 400)."""
        try:
            self.core.runner.add_lora(request)
        except ValueError as e:
            logger.warning("%s", e)
            return str(e)
        return None

    def _remove_lora(self, lora_int_id: int) -> bool:
        """Unload a LoRA adapter: its slot is freed once no unfinished request uses it."""
        return self.core.runner.remove_lora(lora_int_id)

    def _kv_save(self, args: tuple[str, list[int], str | None]) -> dict[str, Any]:
        """/v1/kv/save: {"num_tokens"} saved, or {"error"} naming why not (a 400)."""
        try:
            return {"num_tokens": self.core.save_kv(*args)}
        except ValueError as e:
            return {"error": str(e)}

    def _kv_restore(self, name: str) -> dict[str, Any]:
        """/v1/kv/restore: {"num_tokens"} restored, or {"error"} naming why not (a 400)."""
        try:
            return {"num_tokens": self.core.restore_kv(name)}
        except ValueError as e:
            return {"error": str(e)}

    def _kv_usage(self) -> dict[str, Any]:
        """Requests held and KV blocks in use (cached free blocks count as free): a graceful
        stop asks this until everything it aborted is let go."""
        return {"num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "num_paused": len(self.scheduler.paused),
                "kv_blocks_used": self.num_total_blocks - self.kv.num_free_blocks,
                "kv_cache_usage": self.kv.usage}

    def _kv_snapshot(self) -> Any:
        """Between steps: copy the block arrays and figures; with the mean full cost (taking,
        pickling, sending) of the snapshots before it."""
        t0 = time.perf_counter()
        snapshot = take_kv_snapshot(self.scheduler)
        snapshot.take_seconds = time.perf_counter() - t0
        snapshot.step_seconds_mean = (
            sum(self._step_seconds) / len(self._step_seconds) if self._step_seconds else 0.0
        )
        if self._utility_calls.get("kv_snapshot"):
            snapshot.cost_seconds_mean = self._utility_seconds["kv_snapshot"] / self._utility_calls["kv_snapshot"]
        return snapshot

    def _note_scheduled(self, step_start: float) -> None:
        """Requests that left WAITING in the step begun at ``step_start`` were scheduled then
        (aborted ones left in _abort; one the core failed before scheduling is not counted)."""
        if not self._unscheduled:
            return
        for request_id, request in list(self._unscheduled.items()):
            if request.status == RequestStatus.WAITING:
                continue
            del self._unscheduled[request_id]
            if request.status != RequestStatus.FINISHED_ABORTED:
                self._queue_times.append(step_start - request.arrival_time)
                self._scheduled_at[request_id] = step_start

    def _stamp_scheduled(self, outputs: list[EngineCoreOutput]) -> None:
        """A request's first output carries when it was first scheduled (its prefill time)."""
        if not self._scheduled_at:
            return
        for out in outputs:
            scheduled = self._scheduled_at.pop(out.request_id, None)
            if scheduled is not None:
                out.scheduled_time = scheduled

    def _make_stats(self) -> CoreStats:
        queue_times, self._queue_times = self._queue_times, []
        iteration_tokens, self._iteration_tokens = self._iteration_tokens, []
        return CoreStats(
            scheduler_stats=self.core.get_stats(),
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.num_total_blocks,
            queue_times=queue_times,
            iteration_tokens=iteration_tokens,
            kv_transfer=self.core.kv_connector.get_stats() if self.core.kv_connector is not None else None,
        )
