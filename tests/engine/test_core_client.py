"""CoreClient against a stand-in core process (no model): the core's death is noticed at once
(the process sentinel), and a send to a dead core fails at once instead of blocking."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time

import pytest

from pagedllm.engine.core_client import CoreClient, EngineDeadError, StartedCore
from pagedllm.engine.core_messages import CoreOutputs, dumps


def _fake_core(input_addr: str, output_addr: str) -> None:
    """Connects like the core, sends one batch of outputs, then waits to be killed."""
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(input_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(output_addr)
    push.send(dumps("outputs", CoreOutputs([])))
    time.sleep(600)


@pytest.fixture
def started():
    tmpdir = tempfile.mkdtemp(prefix="pagedllm-test-")
    input_addr, output_addr = f"ipc://{tmpdir}/input", f"ipc://{tmpdir}/output"
    proc = multiprocessing.get_context("spawn").Process(target=_fake_core, args=(input_addr, output_addr), daemon=True)
    proc.start()
    yield StartedCore(proc, tmpdir, input_addr, output_addr)
    if proc.is_alive():
        proc.kill()
    proc.join()
    shutil.rmtree(tmpdir, ignore_errors=True)


def test_dead_core_is_noticed_at_once_and_sends_fail_fast(started):
    async def run() -> tuple[float, BaseException | None, bool]:
        client = CoreClient(None, started)  # type: ignore[arg-type]  # args unused with a started core
        assert (await asyncio.wait_for(client.get_outputs(), 60)).outputs == []
        client.abort_requests(["r1"])  # a live core takes sends
        waiting = asyncio.ensure_future(client.get_outputs())
        await asyncio.sleep(0.2)
        os.kill(started.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="exited with code -9"):
            await asyncio.wait_for(waiting, 5)
        noticed_s = time.monotonic() - t0
        # A send to the dead core, on a thread so that a blocking send cannot hang the test.
        result: list[BaseException | None] = []

        def send() -> None:
            try:
                client.add_request(object())  # type: ignore[arg-type]  # pickled as is
                result.append(None)
            except BaseException as e:  # noqa: BLE001
                result.append(e)

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        thread.join(2.0)
        client.abort_requests(["r1"])  # no core to abort in: a no-op, never an error
        await asyncio.get_running_loop().run_in_executor(None, client.shutdown)
        return noticed_s, result[0] if result else None, thread.is_alive()

    noticed_s, send_error, send_blocked = asyncio.run(run())
    print(f"core death noticed after {noticed_s:.3f} s")
    assert noticed_s < 0.5
    assert not send_blocked, "a send to the dead core blocked"
    assert isinstance(send_error, EngineDeadError), send_error
