"""ZmqConnector, worker side: KV blocks over TCP with pyzmq, zero-copy.

Producer: a ROUTER socket on ``tcp://kv_host:kv_port``, served by a background thread.
A held transfer is registered as {hash: block id}. A pull names the transfer and the hashes
it wants; the answer is one multipart message: a JSON header, then one frame per run of
consecutive block ids, per layer tensor, for K then V. Each frame is a view of the cache
tensor (no copy), so a hold ends only once zmq's tracker says zmq let go of the frames; the
thread checks trackers each turn and never waits on one, so a stalled consumer does not hold
up other pulls. Invariant: a transfer's blocks are reported freed (``finished_sending``) only
while no send of them is in flight. An answer still unsent after ``kv_send_timeout_s`` (a
consumer stopped, or gone without a reset) is aborted: the thread closes and rebinds the
ROUTER, zmq drops the answers in flight, their trackers complete, and only then are their
blocks freed. Their consumers time out and recompute.

Consumer: a background thread takes loads in order; each opens a DEALER to the producer,
sends the pull, waits up to ``kv_transfer_timeout_s`` and copies the frames into the
allocated blocks. Those blocks are not in any batch until the load is reported finished.

Wire header fields: ok, error, transfer_id, runs [[first hash index, count]], block_size,
num_kv_heads, head_dim, num_layers, dtype, kv_cache_dtype ("auto" or an 8-bit format's name,
layers/kv_quant.py); a consumer refuses a geometry unlike its own.

Hardening (docs/security.md): both threads survive any message and any socket error (only the
transfer concerned fails); a thread that dies anyway is counted in ``get_stats()`` as
``dead_threads`` and turns the server's /health to 503. A consumer caps each received frame
at the size the geometry implies for the blocks it asked for (zmq drops a larger one before
it is buffered) and refuses an answer whose frames are not exactly that size; a pull is given
up at its ``LoadSpec.deadline``, queued or in flight.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass

import torch
import zmq

from pagedllm import faults
from pagedllm.layers.kv_quant import SCALE_BYTES, quant_format

from pagedllm.distributed.kv_transfer.base import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorWorkerBase,
    LoadSpec,
    ReleaseSpec,
)
from pagedllm.distributed.kv_transfer.config import KVTransferConfig
from pagedllm.distributed.kv_transfer.wire import PULL, RELEASE, send_release

logger = logging.getLogger(__name__)

_REGISTRATION_WAIT_S = 5.0  # a pull may outrun the registration of its transfer by a step
_REBIND_WAIT_S = 5.0  # the closed ROUTER's listener goes away asynchronously
_NUM_DONE_REMEMBERED = 4096  # ended transfers, to refuse a late pull at once
_DEAD_PEER_S = 5.0  # after a pull timed out, later pulls from that address fail at once
_MAX_PENDING = 1024  # pulls waiting for their transfer's registration; beyond it, refused
_MAX_HEADER_BYTES = 1 << 16  # an answer's JSON header, beyond its runs
_ERROR_PAUSE_S = 0.05  # after an unexpected error in a loop, before the next turn


@dataclass
class _Send:
    """An answer handed to zmq, which may still read the blocks' memory."""

    tracker: zmq.MessageTracker
    deadline: float  # abort it if still unsent by then
    num_blocks: int
    num_bytes: int
    aborted: bool = False


@dataclass
class _Held:
    blocks: dict[bytes, int]  # hash -> block id
    deadline: float  # freed unpulled after this (not while a send is in flight)
    send: _Send | None = None

    @property
    def in_flight(self) -> bool:
        return self.send is not None


def block_runs(indices_ids: list[int]) -> list[tuple[int, int]]:
    """Split a list of block ids into runs of consecutive ids: (start index, count)."""
    runs: list[tuple[int, int]] = []
    for i, block_id in enumerate(indices_ids):
        if runs and block_id == indices_ids[runs[-1][0]] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


class ZmqConnectorWorker(KVConnectorWorkerBase):
    def __init__(self, config: KVTransferConfig, kv_caches: list[torch.Tensor]) -> None:
        # kv_caches: one [2, num_blocks, block_size, num_kv_heads, head_dim (+ 4)] tensor per layer slot
        self.config = config
        self.kv_caches = kv_caches
        _, _, self.block_size, self.num_kv_heads, self.row_width = kv_caches[0].shape
        self.dtype = kv_caches[0].dtype
        fmt = quant_format(kv_caches[0])
        self.kv_cache_dtype = "auto" if fmt is None else fmt.name
        self.head_dim = self.row_width - (0 if fmt is None else SCALE_BYTES)
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._held: dict[str, _Held] = {}
        self._done: OrderedDict[str, None] = OrderedDict()
        self._output = KVConnectorOutput()
        self._stats = {"blocks_sent": 0, "bytes_sent": 0, "blocks_received": 0, "bytes_received": 0,
                       "seconds": 0.0, "failed_loads": 0, "expired_holds": 0, "aborted_sends": 0}
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._threads: list[threading.Thread] = []
        self._jobs: queue.Queue[LoadSpec | ReleaseSpec | None] = queue.Queue()
        self._dead_until: dict[tuple[str, int], float] = {}  # loader thread only
        if config.is_producer:
            self._router = self._bind_router()
            self._start(self._serve_loop, "kv-transfer-server")
            logger.info("KV transfer server on tcp://%s:%d (%s)", config.kv_host, config.kv_port, config.kv_role)
        if config.is_consumer:
            self._start(self._load_loop, "kv-transfer-loader")

    def _start(self, target, name: str) -> None:
        def run() -> None:
            try:
                target()
            except BaseException:  # its loop catches everything; this is the last word
                logger.critical("KV transfer thread %s died; /health now answers 503", name, exc_info=True)

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    @property
    def num_dead_threads(self) -> int:
        if self._stop.is_set():
            return 0
        return sum(not t.is_alive() for t in self._threads)

    # ---- the engine's calls --------------------------------------------------------------

    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None:
        if not metadata:
            return
        deadline = time.monotonic() + self.config.kv_hold_timeout_s
        with self._lock:
            for send in metadata.sends:
                self._held[send.transfer_id] = _Held(dict(zip(send.block_hashes, send.block_ids)), deadline)
        for job in [*metadata.loads, *metadata.releases]:
            self._jobs.put(job)

    def get_finished(self) -> KVConnectorOutput:
        now = time.monotonic()
        with self._lock:
            for transfer_id, held in list(self._held.items()):
                if not held.in_flight and now > held.deadline:
                    self._end_hold(transfer_id)
                    self._stats["expired_holds"] += 1
                    logger.warning("KV transfer %s was not pulled within %.0f s; its blocks are freed",
                                   transfer_id, self.config.kv_hold_timeout_s)
            out, self._output = self._output, KVConnectorOutput()
            self._event.clear()
        return out

    def wait_for_transfers(self, timeout_s: float) -> None:
        self._event.wait(timeout_s)

    def get_stats(self) -> dict[str, float]:
        with self._lock:
            stats = dict(self._stats)
        stats["dead_threads"] = self.num_dead_threads
        return stats

    def shutdown(self) -> None:
        self._stop.set()
        self._jobs.put(None)
        for thread in self._threads:
            thread.join(timeout=2.0)
        self._ctx.destroy(linger=0)

    def _end_hold(self, transfer_id: str) -> None:
        """Under the lock: the hold is over, the scheduler frees its blocks."""
        self._held.pop(transfer_id, None)
        self._output.finished_sending.add(transfer_id)
        self._done[transfer_id] = None
        if len(self._done) > _NUM_DONE_REMEMBERED:
            self._done.popitem(last=False)
        self._event.set()

    def _finish(self, **kwargs) -> None:
        with self._lock:
            out = self._output
            out.finished_sending |= kwargs.get("sending", set())
            out.finished_recving |= kwargs.get("recving", set())
            out.failed_recving.update(kwargs.get("failed", {}))
            self._event.set()

    # ---- producer: serve held blocks -------------------------------------------------------

    def _bind_router(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        address = f"tcp://{self.config.kv_host}:{self.config.kv_port}"
        deadline = time.monotonic() + _REBIND_WAIT_S
        while True:
            try:
                sock.bind(address)
                return sock
            except zmq.ZMQError:
                if time.monotonic() > deadline:
                    sock.close()
                    raise
                time.sleep(0.05)

    def _serve_loop(self) -> None:
        pending: list[tuple[float, list[bytes]]] = []  # pulls for transfers not registered yet
        while not self._stop.is_set():
            try:
                with self._lock:
                    busy = pending or any(h.in_flight for h in self._held.values())
                if self._router.poll(20 if busy else 200):
                    msg = self._router.recv_multipart()
                    # Beyond _MAX_PENDING, a pull of an unknown transfer is refused at once.
                    wait = _REGISTRATION_WAIT_S if len(pending) < _MAX_PENDING else -1.0
                    pending.append((time.monotonic() + wait, msg))
                still = []
                for deadline, msg in pending:
                    try:
                        handled = self._handle(msg, give_up=time.monotonic() > deadline)
                    except Exception as e:  # noqa: BLE001 -- a malformed message: drop it, serve on
                        logger.warning("KV transfer server dropped a malformed message: %s: %.200s",
                                       type(e).__name__, e)
                        handled = True
                    if not handled:
                        still.append((deadline, msg))
                pending = still
                if self._reap_sends():
                    self._abort_sends()
                    pending = []  # their identities belonged to the closed socket
            except Exception:  # noqa: BLE001 -- the server thread must outlive any error
                if self._stop.is_set():
                    return
                logger.exception("KV transfer server error")
                if self._router.closed:  # a rebind after an abort failed: try again (it waits)
                    try:
                        self._router = self._bind_router()
                    except zmq.ZMQError:
                        pass
                time.sleep(_ERROR_PAUSE_S)

    def _reap_sends(self) -> bool:
        """End the holds whose sends zmq has let go of; True if a send is past its deadline."""
        now = time.monotonic()
        overdue = False
        with self._lock:
            for transfer_id, held in list(self._held.items()):
                send = held.send
                if send is None:
                    continue
                if send.tracker.done:
                    if send.aborted:
                        self._stats["aborted_sends"] += 1
                    else:
                        self._stats["blocks_sent"] += send.num_blocks
                        self._stats["bytes_sent"] += send.num_bytes
                    self._end_hold(transfer_id)
                elif not send.aborted and now > send.deadline:
                    overdue = True
        return overdue

    def _abort_sends(self) -> None:
        """Drop every answer in flight by closing the ROUTER (zmq then releases their frames,
        and ``_reap_sends`` frees the blocks once each tracker says so) and bind a new one."""
        with self._lock:
            sends = [h.send for h in self._held.values() if h.send is not None]
            for send in sends:
                send.aborted = True
        logger.warning("KV transfer server: %d answers unsent after %.0f s (a consumer stalled or gone); "
                       "reopening the socket to drop them", len(sends), self.config.kv_send_timeout_s)
        self._router.close(linger=0)
        self._router = self._bind_router()

    def _handle(self, msg: list[bytes], give_up: bool) -> bool:
        """Answer one message; False to retry later (transfer not registered yet). Raises
        ValueError for a malformed one."""
        if len(msg) != 3 or msg[1] not in (PULL, RELEASE):
            raise ValueError(f"expected [kind, JSON] with kind pull or release, got {len(msg) - 1} frames")
        identity, kind, raw = msg
        req = json.loads(raw)
        if not isinstance(req, dict) or not isinstance(req.get("transfer_id"), str):
            raise ValueError("the message is not a JSON object with a string transfer_id")
        transfer_id = req["transfer_id"]
        hashes_hex = req.get("hashes")
        if kind == PULL and (not isinstance(hashes_hex, list) or not all(isinstance(h, str) for h in hashes_hex)):
            self._reply_error(identity, transfer_id, "a pull's hashes must be a list of hex strings")
            raise ValueError("a pull's hashes are not a list of hex strings")
        with self._lock:
            held = self._held.get(transfer_id)
            if held is None and not give_up and transfer_id not in self._done:
                return False
            if kind == RELEASE:
                if held is not None and not held.in_flight:
                    self._end_hold(transfer_id)
                return True
            if held is None or held.in_flight:
                self._reply_error(identity, transfer_id, "the prefill instance holds no blocks under this "
                                  "transfer id (expired, already pulled, or unknown)")
                return True
            try:
                hashes = [bytes.fromhex(h) for h in hashes_hex]
            except ValueError:
                self._reply_error(identity, transfer_id, "a pull's hashes must be hex strings")
                raise
            missing = [h for h in hashes if h not in held.blocks]
            if missing:
                self._reply_error(identity, transfer_id, f"{len(missing)} requested blocks are not held")
                return True
            block_ids = [held.blocks[h] for h in hashes]
            # Marked in flight before zmq sees the frames: from here only _reap_sends frees them.
            held.send = self._send_blocks(identity, transfer_id, block_ids)
        return True

    def _reply_error(self, identity: bytes, transfer_id: str, error: str) -> None:
        header = {"ok": False, "error": error, "transfer_id": transfer_id}
        self._router.send_multipart([identity, json.dumps(header).encode()])

    def _send_blocks(self, identity: bytes, transfer_id: str, block_ids: list[int]) -> _Send:
        """Hand zmq one answer whose frames are views of the blocks (no copy)."""
        runs = block_runs(block_ids)
        header = {
            "ok": True, "transfer_id": transfer_id, "runs": runs, "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "num_layers": len(self.kv_caches), "dtype": str(self.dtype), "kv_cache_dtype": self.kv_cache_dtype,
        }
        frames: list = [identity, json.dumps(header).encode()]
        for start, count in runs:
            first = block_ids[start]
            for cache in self.kv_caches:
                for kv in (0, 1):
                    # A contiguous slice of the pool: the frame reads the tensor's memory.
                    frames.append(cache[kv, first : first + count].view(torch.uint8).numpy())
        tracker = self._router.send_multipart(frames, copy=False, track=True)
        num_bytes = sum(f.nbytes for f in frames[2:])
        deadline = time.monotonic() + self.config.kv_send_timeout_s
        return _Send(tracker, deadline, len(block_ids), num_bytes)

    # ---- consumer: pull blocks -------------------------------------------------------------

    def _load_loop(self) -> None:
        while not self._stop.is_set():
            job = self._jobs.get()
            if job is None:
                return
            faults.maybe_raise("kv_loader", getattr(job, "req_id", job.transfer_id))
            try:
                self._load_one(job)
            except Exception:  # noqa: BLE001 -- the loader must outlive any job
                logger.exception("KV transfer loader error")

    def _load_one(self, job: LoadSpec | ReleaseSpec) -> None:
        if isinstance(job, ReleaseSpec):
            try:
                self._send_release(job)
            except Exception as e:  # noqa: BLE001 -- the producer frees them on its hold timeout
                logger.warning("KV release of %s to %s:%s failed: %s", job.transfer_id, job.remote_host,
                               job.remote_port, e)
            return
        t0 = time.monotonic()
        try:
            num_bytes = self._pull(job)
        except Exception as e:  # any failure: the scheduler recomputes (or fails) the request
            logger.warning("KV pull for request %s from %s:%s failed: %s",
                           job.req_id, job.remote_host, job.remote_port, e)
            with self._lock:
                self._stats["failed_loads"] += 1
            self._finish(failed={job.req_id: str(e) or type(e).__name__})
            return
        elapsed = time.monotonic() - t0
        with self._lock:
            self._stats["blocks_received"] += len(job.block_ids)
            self._stats["bytes_received"] += num_bytes
            self._stats["seconds"] += elapsed
        logger.debug("pulled %d blocks (%.1f MB) for %s in %.1f ms (%.0f MB/s)", len(job.block_ids),
                     num_bytes / 1e6, job.req_id, elapsed * 1e3, num_bytes / 1e6 / max(elapsed, 1e-9))
        self._finish(recving={job.req_id})

    def _dealer(self, host: str, port: int, max_frame_bytes: int) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # zmq drops a larger frame (and the connection) before buffering it.
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.connect(f"tcp://{'[' + host + ']' if ':' in host else host}:{port}")
        except zmq.ZMQError:
            sock.close()
            raise
        return sock

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V): one frame holds a run of them."""
        return self.block_size * self.num_kv_heads * self.row_width * self.dtype.itemsize

    def _send_release(self, job: ReleaseSpec) -> None:
        send_release(self._ctx, job.remote_host, job.remote_port, job.transfer_id)

    def _pull(self, job: LoadSpec) -> int:
        """Fetch the blocks and copy them into place; returns bytes received."""
        address = (job.remote_host, job.remote_port)
        now = time.monotonic()
        if now < self._dead_until.get(address, 0.0):
            raise TimeoutError(f"{job.remote_host}:{job.remote_port} did not answer a pull moments ago")
        timeout_s = self.config.kv_transfer_timeout_s
        if job.deadline is not None:
            if now >= job.deadline:
                raise TimeoutError("the request's wait for remote KV ended before its pull started")
            timeout_s = min(timeout_s, job.deadline - now)
        num_blocks = len(job.block_ids)
        max_frame = max(num_blocks * self.block_bytes, _MAX_HEADER_BYTES + 32 * num_blocks)
        sock = self._dealer(job.remote_host, job.remote_port, max_frame)
        try:
            request = {"transfer_id": job.transfer_id, "hashes": [h.hex() for h in job.block_hashes]}
            sock.send_multipart([PULL, json.dumps(request).encode()])
            if not sock.poll(int(timeout_s * 1000)):
                # Queued pulls from a dead instance fail fast instead of each waiting in turn.
                self._dead_until[address] = time.monotonic() + _DEAD_PEER_S
                raise TimeoutError(f"no answer within {timeout_s:.3g} s")
            frames = sock.recv_multipart(copy=False)
        finally:
            sock.close()
        header = json.loads(frames[0].bytes)
        if not isinstance(header, dict):
            raise RuntimeError("malformed answer: the header is not a JSON object")
        if not header.get("ok"):
            raise RuntimeError(str(header.get("error", "refused"))[:500])
        self._check_geometry(header)
        runs = self._check_runs(header.get("runs"), job.block_ids)
        expected = len(runs) * len(self.kv_caches) * 2
        if len(frames) - 1 != expected:
            raise RuntimeError(f"malformed answer: {len(frames) - 1} frames, expected {expected}")
        for (_, count), i in zip(runs, range(1, len(frames), 2 * len(self.kv_caches))):
            for frame in frames[i : i + 2 * len(self.kv_caches)]:
                if len(frame.buffer) != count * self.block_bytes:
                    raise RuntimeError(f"malformed answer: a frame of {len(frame.buffer)} bytes for {count} "
                                       f"blocks, expected {count * self.block_bytes}")
        shape = (self.block_size, self.num_kv_heads, self.row_width * self.dtype.itemsize)
        it = iter(frames[1:])
        num_bytes = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # zmq frames are read-only buffers; we only read them
            for start, count in runs:
                dst = torch.tensor(job.block_ids[start : start + count], dtype=torch.int64)
                for cache in self.kv_caches:
                    for kv in (0, 1):
                        frame = next(it)
                        # As bytes: fp8 tensors have no index_copy_.
                        src = torch.frombuffer(frame.buffer, dtype=torch.uint8)
                        cache[kv].view(torch.uint8).index_copy_(0, dst, src.view(count, *shape))
                        num_bytes += len(frame.buffer)
        return num_bytes

    @staticmethod
    def _check_runs(runs: object, block_ids: list[int]) -> list[tuple[int, int]]:
        """The answer's runs must tile the requested blocks in order: [[start, count], ...]."""
        ok = isinstance(runs, list)
        next_start = 0
        for run in runs if ok else ():
            if not (isinstance(run, list) and len(run) == 2 and all(type(v) is int for v in run)
                    and run[0] == next_start and run[1] > 0):
                ok = False
                break
            next_start += run[1]
        if not ok or next_start != len(block_ids):
            raise RuntimeError(f"malformed answer: its runs do not cover the {len(block_ids)} requested blocks")
        return [tuple(r) for r in runs]

    def _check_geometry(self, header: dict) -> None:
        mine = {"block_size": self.block_size, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "num_layers": len(self.kv_caches), "dtype": str(self.dtype),
                "kv_cache_dtype": self.kv_cache_dtype}
        theirs = {k: header.get(k) for k in mine}
        if theirs != mine:
            differ = ", ".join(f"{k} {theirs[k]!r} (ours {mine[k]!r})" for k in mine if theirs[k] != mine[k])
            raise RuntimeError(f"the prefill instance's KV layout differs from ours: {differ}; run both "
                               "with the same model, --dtype, --block-size and --kv-cache-dtype")
