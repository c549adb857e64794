"""Front-end side of the engine-core process: spawn it, send requests, receive outputs.

The front end binds two IPC sockets in a private temporary directory; the core process
connects. Sends never block the event loop: the input socket has no high-water mark (admission
control bounds what is in flight) and sends with NOBLOCK, which fails at once, as
``EngineDeadError``, only when no core is connected (it died). Outputs arrive on an asyncio
socket. The core's death is noticed at once: the loop watches the process sentinel (a file
descriptor readable when the process ends), and a receive waits on both.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from pagedllm.config import EngineConfig
from pagedllm.engine.core_messages import CoreOutputs, ReadyInfo, dumps, loads
from pagedllm.engine.core_proc import run_engine_core
from pagedllm.request import Request

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine-core process exited or failed to start."""


class UtilityError(RuntimeError):
    """A utility raised in the engine core (the core goes on)."""


@dataclass
class StartedCore:
    """An engine-core process already loading, and the IPC addresses it connects to."""

    proc: Any
    """The multiprocessing.Process."""
    tmpdir: str
    input_addr: str
    output_addr: str


def start_engine_core(config: EngineConfig, cpus: list[int] | None = None, name: str = "pagedllm-engine-core"
                      ) -> StartedCore:
    """Spawn the engine-core process. `pagedllm serve` calls this first thing, so the core
    loads the model while the front end imports its own modules (the core connects to
    addresses the front end binds later: ZMQ queues its messages until then). ``cpus``: the
    cores to pin it to (a data-parallel replica), None to leave it on every core."""
    tmpdir = tempfile.mkdtemp(prefix="pagedllm-")
    input_addr = f"ipc://{tmpdir}/input"
    output_addr = f"ipc://{tmpdir}/output"
    mp = multiprocessing.get_context("spawn")
    proc = mp.Process(
        target=run_engine_core,
        args=(config, input_addr, output_addr, os.getpid(), logging.getLogger().getEffectiveLevel(), cpus),
        name=name,
        daemon=True,
    )
    proc.start()
    logger.info("started engine core process pid %d", proc.pid)
    return StartedCore(proc, tmpdir, input_addr, output_addr)


class CoreClient:
    """Owns the engine-core process and the two sockets to it."""

    def __init__(self, config: EngineConfig | Any, started: StartedCore | None = None) -> None:
        if started is None:
            # The front end's AsyncLLM still hands over its EngineArgs (entrypoints/ builds
            # both): anything but a finished EngineConfig is turned into one here, once.
            if not isinstance(config, EngineConfig):
                config = config.create_engine_config()
            started = start_engine_core(config)
        self._tmpdir = started.tmpdir
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._in = self._sync_ctx.socket(zmq.PUSH)  # to the core
        self._in.setsockopt(zmq.SNDHWM, 0)  # no bound: a full queue would make sends fail or block
        self._in.bind(started.input_addr)
        self._out = self._async_ctx.socket(zmq.PULL)  # from the core
        self._out.bind(started.output_addr)
        self.proc = started.proc
        self._utility_waiters: dict[str, list[asyncio.Future]] = {}
        self._closed = False
        self._stopping = False  # shutdown() has begun
        # Set (to an EngineDeadError) when the core process ends; the loop watches its sentinel.
        self._loop = asyncio.get_running_loop()
        self._core_exited: asyncio.Future = self._loop.create_future()
        self._loop.add_reader(self.proc.sentinel, self._on_core_exit)

    def _on_core_exit(self) -> None:
        self._loop.remove_reader(self.proc.sentinel)
        if self._stopping:  # shutdown() reaps it, on its thread: one waitpid only
            error = EngineDeadError("the engine is shut down")
        else:
            self.proc.join(1.0)  # it has exited: reap it, so exitcode is known
            error = EngineDeadError(f"the engine core process exited with code {self.proc.exitcode}")
        self._core_exited.set_exception(error)
        self._core_exited.exception()  # retrieved here: no "never retrieved" warning if unawaited
        self._fail_utility_waiters(error)

    def _fail_utility_waiters(self, error: BaseException) -> None:
        for waiters in self._utility_waiters.values():
            for fut in waiters:
                if not fut.done():
                    fut.set_exception(error)
        self._utility_waiters.clear()

    # ---- front end -> core ------------------------------------------------------------

    def _send(self, kind: str, payload: Any = None) -> None:
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        if self._core_exited.done():
            raise self._core_exited.exception()  # type: ignore[misc]
        try:
            self._in.send(dumps(kind, payload), zmq.NOBLOCK, copy=False)
        except zmq.Again:  # with no high-water mark: no core is connected
            raise EngineDeadError("the engine core is not connected (it exited)") from None

    def add_request(self, request: Request) -> None:
        self._send("add", request)

    def add_beam_search(self, request_id: str, prompt_token_ids: list[int], params: Any) -> None:
        self._send("add_beam_search", (request_id, prompt_token_ids, params))

    def abort_requests(self, request_ids: list[str], stopped: bool = False) -> None:
        """Abort in the core; nothing to do if the core is gone (it holds no request then)."""
        if request_ids and not self._closed:
            try:
                self._send("abort", (list(request_ids), stopped))
            except EngineDeadError:
                pass

    def pause_requests(self, request_ids: list[str], pause: bool = True) -> None:
        """Stop (or, with ``pause=False``, resume) scheduling requests in the core; nothing to
        do if the core is gone."""
        if request_ids and not self._closed:
            try:
                self._send("pause" if pause else "resume", list(request_ids))
            except EngineDeadError:
                pass

    async def call_utility(self, name: str, payload: Any = None) -> Any:
        """Run a named utility in the core (e.g. reset_prefix_cache, or add_lora with its
        payload) and await its result; UtilityError if it raised there, EngineDeadError if
        the core is gone."""
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._send(name, payload)
        self._utility_waiters.setdefault(name, []).append(future)
        return await future

    def replica_states(self) -> list[dict[str, Any]]:
        """Data-parallel replicas' figures (dp_client.py); one core has none."""
        return []

    # ---- core -> front end ------------------------------------------------------------

    async def wait_ready(self) -> ReadyInfo:
        kind, payload = await self._recv()
        if kind == "failed":
            raise EngineDeadError(f"the engine core failed to start: {payload}")
        assert kind == "ready", kind
        return payload

    async def get_outputs(self) -> CoreOutputs:
        """The next batch of outputs; utility results are dispatched on the way."""
        while True:
            kind, payload = await self._recv()
            if kind == "outputs":
                return payload
            if kind == "utility":
                name, result, error = payload
                waiters = self._utility_waiters.get(name)
                if waiters:
                    fut = waiters.pop(0)
                    if fut.done():
                        pass
                    elif error is not None:
                        fut.set_exception(UtilityError(f"the engine's {name} failed: {error}"))
                    else:
                        fut.set_result(result)
            else:
                logger.error("unexpected message kind %r from the engine core", kind)

    async def _recv(self) -> tuple[str, Any]:
        """Receive one message; raise EngineDeadError as soon as the core process exits (what
        it sent before is received first)."""
        if self._core_exited.done():
            try:
                return loads(await self._out.recv(zmq.NOBLOCK))
            except zmq.Again:
                raise self._core_exited.exception() from None  # type: ignore[misc]
        recv = self._out.recv()
        await asyncio.wait((recv, self._core_exited), return_when=asyncio.FIRST_COMPLETED)
        if recv.done():
            return loads(recv.result())
        recv.cancel()
        return await self._recv()

    # ---- shutdown ---------------------------------------------------------------------

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the core (politely, then by force) and release the sockets."""
        if self._closed:
            return
        self._stopping = True
        if self.proc.is_alive():
            try:
                self._in.send(dumps("shutdown"), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.proc.join(timeout_s)
        if self.proc.is_alive():
            logger.warning("engine core did not stop in %.0f s; terminating it", timeout_s)
            self.proc.terminate()
            self.proc.join(2.0)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
        self._closed = True
        # shutdown runs in an executor thread: the futures belong to the loop.
        self._loop.call_soon_threadsafe(self._fail_utility_waiters, EngineDeadError("the engine is shut down"))
        self._in.close(linger=0)
        self._out.close(linger=0)
        self._sync_ctx.term()
        self._async_ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
        logger.info("engine core process stopped (exit code %s)", self.proc.exitcode)
