"""The ``mp`` executor: ranks 1..N-1 as worker processes on this machine.

Each worker is a fresh Python process (``subprocess``, so a daemonic engine-core process may
start it) holding one end of a socket pair to rank 0: it receives its WorkerSpec, loads its
shard, reports back, joins the gloo group, builds its runner, then executes every pickled
SchedulerOutput that arrives (an empty message stops it). Workers die with the process that
started them (PR_SET_PDEATHSIG), so nothing is left behind even after a ``kill -9``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, wait

from pagedllm.distributed.executor import DistributedExecutor

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0
"""Longest a worker may take to load its shard."""
STOP_TIMEOUT_S = 5.0


class MPExecutor(DistributedExecutor):
    backend = "mp"

    def _launch_workers(self) -> None:
        self.procs: dict[int, subprocess.Popen] = {}
        self.conns: dict[int, Connection] = {}
        for rank in range(1, self.size):
            ours, theirs = socket.socketpair()
            code = "from pagedllm.distributed.mp_executor import worker_main; worker_main()"
            self.procs[rank] = subprocess.Popen(
                [sys.executable, "-c", code, str(rank), str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()],
            )
            theirs.close()
            self.conns[rank] = Connection(ours.detach())
            self.conns[rank].send((self.worker_spec(rank), logging.getLogger().level))

    def _start_workers(self, block_size: int, num_blocks: int) -> None:
        self._gather("loaded")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        for conn in self.conns.values():
            conn.send((init_method, block_size, num_blocks))
        self.group.init_process_group(init_method)
        self._gather("ready")
        self._running = True
        for rank, proc in self.procs.items():
            threading.Thread(target=self._watch, args=(rank, proc), daemon=True, name=f"tp-watch-{rank}").start()

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        """Log a worker's death when it happens (the engine fails at its next step)."""
        code = proc.wait()
        if not self._closed:
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            logger.error("tensor-parallel rank %d (pid %d) %s; the engine fails at its next step", rank, proc.pid, how)

    def _gather(self, expected: str) -> None:
        """Wait for every worker's ``expected`` message; a failure or death raises."""
        pending = dict(self.conns)
        deadline = time.monotonic() + START_TIMEOUT_S
        while pending:
            ready = wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RuntimeError(f"tensor-parallel workers {sorted(pending)} did not start in {START_TIMEOUT_S} s")
            for rank, conn in list(pending.items()):
                if conn not in ready:
                    continue
                try:
                    kind, payload = conn.recv()
                except EOFError:
                    raise RuntimeError(f"tensor-parallel worker failed to start: {self._describe(rank)}") from None
                if kind == "failed":
                    raise ValueError(f"tensor-parallel rank {rank} failed to start: {payload}")
                assert kind == expected, (kind, expected)
                del pending[rank]

    def _broadcast(self, data: bytes) -> None:
        for conn in self.conns.values():
            conn.send_bytes(data)

    def _dead_workers(self) -> list[str]:
        # The collective breaks as soon as a peer's socket closes; give the OS a moment to
        # reap the process so its exit status is known.
        deadline = time.monotonic() + 2.0
        while True:
            dead = [rank for rank, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                return [self._describe(rank) for rank in dead]
            time.sleep(0.05)

    def _describe(self, rank: int) -> str:
        proc = self.procs[rank]
        try:
            code = proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return f"rank {rank} (pid {proc.pid}) stopped answering"
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return f"rank {rank} (pid {proc.pid}) {how}"

    def _stop_workers(self) -> None:
        # Running workers stop at an empty message; ones still starting are killed.
        graceful = getattr(self, "_running", False)
        for conn in getattr(self, "conns", {}).values():
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        deadline = time.monotonic() + (STOP_TIMEOUT_S if graceful else 0.0)
        for proc in getattr(self, "procs", {}).values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in getattr(self, "conns", {}).values():
            conn.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_main() -> None:
    """A worker process: argv = rank, socket fd, parent pid."""
    rank, fd, parent_pid = (int(a) for a in sys.argv[1:4])
    from pagedllm.process_utils import die_with_parent

    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; rank 0 decides
    conn = Connection(fd)
    spec, log_level = conn.recv()
    logging.basicConfig(level=log_level, format=f"%(levelname)s %(asctime)s rank{rank} %(name)s: %(message)s")
    from pagedllm.distributed.worker import Worker

    exit_code = 0
    worker = None
    try:
        worker = Worker(spec)
        conn.send(("loaded", None))
        init_method, block_size, num_blocks = conn.recv()
        worker.init_process_group(init_method)
        worker.build_runner(block_size, num_blocks)
        conn.send(("ready", None))
        while data := conn.recv_bytes():
            worker.execute(data)
    except EOFError:
        logger.info("rank 0 is gone; worker exits")
    except BaseException as e:  # noqa: BLE001 -- report, then exit (rank 0's collective fails)
        logger.exception("tensor-parallel worker failed")
        try:
            conn.send(("failed", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        exit_code = 1
    if worker is not None and exit_code == 0:
        worker.shutdown()
    logging.shutdown()
    os._exit(exit_code)  # skip torch's slow interpreter teardown
