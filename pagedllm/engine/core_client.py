"""Front-end side of the engine-core process: spawn it, send requests, receive outputs.

The front end binds two IPC sockets in a private temporary directory; the core process
connects. Sends are non-blocking pushes from the event loop thread; outputs arrive on an
asyncio socket.
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

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_messages import CoreOutputs, ReadyInfo, dumps, loads
from pagedllm.engine.core_proc import run_engine_core
from pagedllm.request import Request

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine-core process exited or failed to start."""


@dataclass
class StartedCore:
    """An engine-core process already loading, and the IPC addresses it connects to."""

    proc: Any
    """The multiprocessing.Process."""
    tmpdir: str
    input_addr: str
    output_addr: str


def start_engine_core(args: EngineArgs) -> StartedCore:
    """Spawn the engine-core process. `pagedllm serve` calls this first thing, so the core
    loads the model while the front end imports its own modules (the core connects to
    addresses the front end binds later: ZMQ queues its messages until then)."""
    tmpdir = tempfile.mkdtemp(prefix="pagedllm-")
    input_addr = f"ipc://{tmpdir}/input"
    output_addr = f"ipc://{tmpdir}/output"
    mp = multiprocessing.get_context("spawn")
    proc = mp.Process(
        target=run_engine_core,
        args=(args, input_addr, output_addr, os.getpid(), logging.getLogger().getEffectiveLevel()),
        name="pagedllm-engine-core",
        daemon=True,
    )
    proc.start()
    logger.info("started engine core process pid %d", proc.pid)
    return StartedCore(proc, tmpdir, input_addr, output_addr)


class CoreClient:
    """Owns the engine-core process and the two sockets to it."""

    def __init__(self, args: EngineArgs, started: StartedCore | None = None) -> None:
        if started is None:
            started = start_engine_core(args)
        self._tmpdir = started.tmpdir
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._in = self._sync_ctx.socket(zmq.PUSH)  # to the core
        self._in.bind(started.input_addr)
        self._out = self._async_ctx.socket(zmq.PULL)  # from the core
        self._out.bind(started.output_addr)
        self.proc = started.proc
        self._utility_waiters: dict[str, list[asyncio.Future]] = {}
        self._closed = False

    # ---- front end -> core ------------------------------------------------------------

    def _send(self, kind: str, payload: Any = None) -> None:
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        self._in.send(dumps(kind, payload), copy=False)

    def add_request(self, request: Request) -> None:
        self._send("add", request)

    def add_beam_search(self, request_id: str, prompt_token_ids: list[int], params: Any) -> None:
        self._send("add_beam_search", (request_id, prompt_token_ids, params))

    def abort_requests(self, request_ids: list[str], stopped: bool = False) -> None:
        if request_ids and not self._closed:
            self._send("abort", (list(request_ids), stopped))

    async def call_utility(self, name: str) -> Any:
        """Run a named utility in the core (e.g. reset_prefix_cache) and await its result."""
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._utility_waiters.setdefault(name, []).append(future)
        self._send(name)
        return await future

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
                name, result = payload
                waiters = self._utility_waiters.get(name)
                if waiters:
                    fut = waiters.pop(0)
                    if not fut.done():
                        fut.set_result(result)
            else:
                logger.error("unexpected message kind %r from the engine core", kind)

    async def _recv(self) -> tuple[str, Any]:
        """Receive one message, checking every second that the core process lives."""
        while True:
            if await self._out.poll(1000):
                return loads(await self._out.recv())
            if not self.proc.is_alive():
                raise EngineDeadError(f"the engine core process exited with code {self.proc.exitcode}")

    # ---- shutdown ---------------------------------------------------------------------

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the core (politely, then by force) and release the sockets."""
        if self._closed:
            return
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
        for fut_list in self._utility_waiters.values():
            for fut in fut_list:
                if not fut.done():
                    fut.set_exception(EngineDeadError("the engine is shut down"))
        self._in.close(linger=0)
        self._out.close(linger=0)
        self._sync_ctx.term()
        self._async_ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
        logger.info("engine core process stopped (exit code %s)", self.proc.exitcode)
