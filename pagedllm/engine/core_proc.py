"""The engine-core process behind the server: a busy loop of scheduler + model runner.

The front end (``core_client.py``) and this process talk over two ZMQ sockets; the
messages are in ``core_messages.py``.

The loop drains the input socket, steps while any request is unfinished, and blocks on the
socket when idle, waking every ``IDLE_STATS_INTERVAL_S`` to send stats, so gauges stay current.
The process dies with its parent: PR_SET_PDEATHSIG on Linux, and a parent-pid check.

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
from typing import Any

from pagedllm import faults
from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_messages import CoreOutputs, CoreStats, ReadyInfo, dumps, loads
from pagedllm.engine.kv_snapshot import take_kv_snapshot
from pagedllm.process_utils import die_with_parent
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_STATS_INTERVAL_S = 0.5
BUSY_STATS_INTERVAL_S = 0.25
KV_POLL_INTERVAL_S = 0.02


def run_engine_core(
    args: EngineArgs, input_addr: str, output_addr: str, parent_pid: int, log_level: int
) -> None:
    """Entry point of the core process (spawned by the front end)."""
    die_with_parent(parent_pid)
    # Ctrl-C reaches the whole process group: the front end decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    import zmq

    ctx = zmq.Context()
    in_sock = ctx.socket(zmq.PULL)
    in_sock.connect(input_addr)
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.connect(output_addr)
    try:
        proc = EngineCoreProc(args, in_sock, out_sock, parent_pid)
    except Exception as e:  # start-up failed: say why, then exit
        logger.exception("engine core failed to start")
        out_sock.send(dumps("failed", f"{type(e).__name__}: {e}"))
        # `pagedllm serve` spawns the core before binding its sockets: wait for it to bind (the
        # core dies with its parent, so this never outlives a front end that is gone).
        out_sock.close(linger=60_000)
        in_sock.close(linger=0)  # ctx.term() waits for every socket to close
        ctx.term()
        raise SystemExit(1) from e
    signal.signal(signal.SIGTERM, lambda *_: proc.request_stop())
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
    # Skip the interpreter's teardown of torch and its thread pools: on a loaded machine it
    # takes longer than the front end waits before terminating the process, and after a
    # failure it could hang with the process still alive (the front end would not notice).
    logging.shutdown()
    os._exit(exit_code)


class EngineCoreProc:
    def __init__(self, args: EngineArgs, in_sock: Any, out_sock: Any, parent_pid: int) -> None:
        import zmq

        from pagedllm.engine.core_builder import build_engine_core

        self._zmq = zmq
        built = build_engine_core(args)
        self.core = built.engine_core
        self.scheduler = built.scheduler
        self.kv = built.scheduler.kv_cache_manager
        self.num_total_blocks = built.config.num_blocks - 1
        self.in_sock = in_sock
        self.out_sock = out_sock
        self.parent_pid = parent_pid
        self._stop = False
        self._unscheduled: dict[str, Request] = {}  # added, not yet scheduled: for queue time
        self._queue_times: list[float] = []
        # Dashboard: durations of recent steps and the mean full cost of a snapshot.
        self._step_seconds: deque[float] = deque(maxlen=32)
        self._snapshot_cost_total = 0.0
        self._num_snapshots = 0
        self._warm_up()
        info = ReadyInfo(built.model_config, built.config, built.tokenizer, self.num_total_blocks)
        out_sock.send(dumps("ready", info))

    def _warm_up(self) -> None:
        """One short request before reporting ready: the first steps pay one-time kernel
        set-up costs that would otherwise land on the first client."""
        t0 = time.monotonic()
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
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
            if os.getppid() != self.parent_pid:
                logger.warning("front end process is gone; engine core exits")
                return
            outputs = []
            if self._has_work() or kv_pending:
                t0 = time.perf_counter()
                outputs = self._step()
                self._step_seconds.append(time.perf_counter() - t0)
            self._note_scheduled()
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
        if kind == "add":
            try:
                self.core.add_request(payload)
                self._unscheduled[payload.request_id] = payload
            except ValueError as e:  # validated in the front end; still never crash the loop
                logger.error("rejected request %s: %s", payload.request_id, e)
                out = EngineCoreOutput(payload.request_id, [], "abort", None, 0)
                self.out_sock.send(dumps("outputs", CoreOutputs([out])))
        elif kind == "add_beam_search":
            request_id, prompt_token_ids, params = payload
            try:
                self.core.add_beam_search(request_id, prompt_token_ids, params)
            except ValueError as e:
                logger.error("rejected beam search %s: %s", request_id, e)
                out = EngineCoreOutput(request_id, [], "abort", None, 0, error=str(e))
                self.out_sock.send(dumps("outputs", CoreOutputs([out])))
        elif kind == "abort":
            request_ids, stopped = payload
            status = RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_ABORTED
            self.core.finish_requests(request_ids, status)
            for request_id in request_ids:
                self._unscheduled.pop(request_id, None)
        elif kind == "reset_prefix_cache":
            self.out_sock.send(dumps("utility", ("reset_prefix_cache", self.kv.reset_prefix_cache())))
        elif kind == "kv_snapshot":
            self._send_kv_snapshot()
        elif kind == "shutdown":
            self._stop = True
        else:
            logger.error("unknown message kind %r", kind)

    def _send_kv_snapshot(self) -> None:
        """Between steps: copy the block arrays and figures, and time the whole cost."""
        t0 = time.perf_counter()
        snapshot = take_kv_snapshot(self.scheduler)
        snapshot.take_seconds = time.perf_counter() - t0
        snapshot.step_seconds_mean = (
            sum(self._step_seconds) / len(self._step_seconds) if self._step_seconds else 0.0
        )
        if self._num_snapshots:
            snapshot.cost_seconds_mean = self._snapshot_cost_total / self._num_snapshots
        self.out_sock.send(dumps("utility", ("kv_snapshot", snapshot)))
        self._snapshot_cost_total += time.perf_counter() - t0
        self._num_snapshots += 1

    def _note_scheduled(self) -> None:
        if not self._unscheduled:
            return
        now = time.monotonic()
        for request_id, request in list(self._unscheduled.items()):
            if request.status != RequestStatus.WAITING:
                del self._unscheduled[request_id]  # aborted ones left in _handle
                self._queue_times.append(now - request.arrival_time)

    def _make_stats(self) -> CoreStats:
        queue_times, self._queue_times = self._queue_times, []
        return CoreStats(
            scheduler_stats=self.core.get_stats(),
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.num_total_blocks,
            queue_times=queue_times,
            kv_transfer=self.core.kv_connector.get_stats() if self.core.kv_connector is not None else None,
        )
