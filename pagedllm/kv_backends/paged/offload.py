"""KV offload tiers behind the paged prefix cache: host memory and a disk directory.

A cached block evicted from the pool (``BlockPool.get_new_blocks``) is copied out before
anything overwrites it, and kept under its prefix-cache hash in two bounded LRU tiers:

- the **CPU tier** (``--kv-offload-cpu-bytes``): block images in this process's memory;
- the **disk tier** (``--kv-offload-dir``, ``--kv-offload-disk-bytes``): one file per block,
  which outlives the process and may be shared by several engines on one machine or a shared
  file system.

A prefix lookup that misses the pool continues its hash chain in the tiers (CPU first, then
disk); the blocks found are loaded into fresh pool blocks instead of being recomputed.

Keys. The prefix-cache hash chain already covers the token ids, the model name, the compute
dtype, the KV storage dtype, the block size, the quantization, the LoRA adapter and the
request's ``cache_salt`` (manager.py). The tiers key a block by
``sha256(namespace || block hash)``, where the namespace is a digest of what the chain does
not cover: the weights file's identity (path, size, mtime), the KV geometry and the pagedllm
version (``engine_namespace``). Two engines share blocks only when all of that agrees.

Files. ``<dir>/<key hex>.kvb``: a fixed preamble (magic, version, header length), a JSON
header (namespace, block hash, geometry: layers, KV heads, head size, block size, dtype;
payload length and crc32), then the payload. Written to a unique temporary name, fsynced and
renamed over the final name, so a reader sees a whole file or none, and two writers of the
same block just replace one whole file by an identical one. A file that fails any check
(magic, header, namespace, hash, geometry, length, checksum) is skipped, counted in
``rejected`` and removed; the block is recomputed.

Threads. The copy out of the pool is a memory copy on the step (``PagedKVWorker.prepare``,
before the forward that may overwrite the evicted blocks); the disk writes (checksum, write,
fsync, rename) run on a writer thread. A request's arrival queues its prompt's chain for a
prefetch thread that reads and checks the disk files ahead of the lookup (``prefetch``); the
lookup at schedule time reads whatever was not prefetched yet (one reader per file at a
time), and ``prepare`` copies the images into the blocks before the forward.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

MAGIC = b"PGKV"
VERSION = 1
_PREAMBLE = struct.Struct("<4sII")  # magic, version, header length
SUFFIX = ".kvb"
TIERS = ("cpu", "disk")
STALE_TMP_S = 3600.0
"""Temporary files older than this (a writer that died) are removed when a store starts."""
PREFETCH_BYTES = 256 * 2**20
PREFETCH_BLOCKS = 1024
"""Most block images read ahead of their lookups (whichever bound is smaller)."""


@dataclass(frozen=True)
class BlockGeometry:
    """What one block image holds: ``[layers, 2 (K, V), block_size, kv_heads, head_size]``
    elements of ``dtype`` (``head_size`` is the row width in elements: head_dim, plus 4 for
    the scale of 8-bit KV codes)."""

    layers: int
    kv_heads: int
    head_size: int
    block_size: int
    dtype: str
    row_bytes: int
    """Bytes of one (token, head) row."""

    @property
    def block_bytes(self) -> int:
        return self.layers * 2 * self.block_size * self.kv_heads * self.row_bytes

    def to_json(self) -> dict[str, Any]:
        return {"layers": self.layers, "kv_heads": self.kv_heads, "head_size": self.head_size,
                "block_size": self.block_size, "dtype": self.dtype, "row_bytes": self.row_bytes}


def engine_namespace(weight_files: list[str], geometry: BlockGeometry, extra: tuple = ()) -> bytes:
    """The digest every tier key starts from: what the prefix-cache hash chain does not cover
    (the weights files' identity: path, size, mtime; the geometry; the pagedllm version) plus
    ``extra`` (settings that change the KV's values)."""
    from pagedllm import __version__

    identity: list[Any] = []
    for path in weight_files:
        st = os.stat(path)
        identity.append([os.path.realpath(path), st.st_size, st.st_mtime_ns])
    blob = json.dumps([identity, geometry.to_json(), __version__, [repr(e) for e in extra]], sort_keys=True)
    return hashlib.sha256(b"pagedllm/kv-offload/v1" + blob.encode()).digest()


@dataclass
class TierStats:
    """One tier's counters (blocks), cumulative since start."""

    hits: int = 0
    misses: int = 0
    stores: int = 0
    rejected: int = 0
    """Disk: files skipped as corrupt, truncated or foreign (recomputed instead)."""
    bytes: int = 0
    """Bytes held now."""


@dataclass
class OffloadOps:
    """One step's work for the worker side: copy evicted blocks out (first), then copy tier
    blocks in."""

    stores: list[tuple[int, bytes]] = field(default_factory=list)
    """(pool block id, prefix-cache hash) of cached blocks evicted this step."""
    loads: list[tuple[int, np.ndarray]] = field(default_factory=list)
    """(pool block id, block image) to write before the forward."""

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads)


class OffloadStore:
    """The CPU and disk tiers of one engine (shared by its KV manager and its worker side,
    which live in one process)."""

    def __init__(
        self,
        geometry: BlockGeometry,
        namespace: bytes,
        cpu_bytes: int = 0,
        disk_dir: str | None = None,
        disk_bytes: int | None = None,
    ) -> None:
        self.geometry = geometry
        self.namespace = namespace
        self.cpu_bytes = cpu_bytes
        self.disk_dir = disk_dir
        self.disk_bytes = disk_bytes
        self.stats = {tier: TierStats() for tier in TIERS}
        self._reported = {tier: TierStats() for tier in TIERS}
        self._lock = threading.Lock()  # the CPU tier, the disk index and the stats
        self._cpu: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._disk: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, LRU first
        self._disk_total = 0
        self._pending: dict[bytes, np.ndarray] = {}  # queued for the disk, not yet renamed
        # (key, block hash, image) to write, or an Event to set once those before it are written.
        self._queue: queue.Queue[tuple[bytes, bytes, np.ndarray] | threading.Event] = queue.Queue()
        self._writer: threading.Thread | None = None
        # Prefetch: block images read from disk ahead of their request's scheduling, kept until
        # its lookup takes them (bounded, oldest dropped), and the reads in flight, so that a
        # block is read (and a bad file rejected) once however many ask for it.
        self._prefetched: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.prefetch_bytes = min(PREFETCH_BYTES, PREFETCH_BLOCKS * geometry.block_bytes)
        self._reading: dict[bytes, threading.Event] = {}
        self._prefetch_queue: queue.Queue[list[bytes] | threading.Event] = queue.Queue()
        if disk_dir is not None:
            os.makedirs(disk_dir, exist_ok=True)
            self._scan_disk()
            self._writer = threading.Thread(target=self._write_loop, name="kv-offload-writer", daemon=True)
            self._writer.start()
            threading.Thread(target=self._prefetch_loop, name="kv-offload-prefetch", daemon=True).start()

    # ---- keys --------------------------------------------------------------------------

    def key(self, block_hash: bytes) -> bytes:
        """The tiers' key of a prefix-cache hash (see the module docstring)."""
        return hashlib.sha256(self.namespace + block_hash).digest()

    def path(self, key: bytes) -> str:
        assert self.disk_dir is not None
        return os.path.join(self.disk_dir, key.hex() + SUFFIX)

    # ---- lookups (scheduler) ------------------------------------------------------------

    def lookup(self, block_hash: bytes) -> np.ndarray | None:
        """The block image stored under ``block_hash``, nearest tier first, or None. A disk
        hit is promoted into the CPU tier."""
        key = self.key(block_hash)
        with self._lock:
            data = self._cpu.get(key)
            if data is not None:
                self._cpu.move_to_end(key)
                self.stats["cpu"].hits += 1
                return data
            if self.cpu_bytes:
                self.stats["cpu"].misses += 1
            if self.disk_dir is None:
                return None
            data = self._pending.get(key)
            if data is None:
                data = self._prefetched.pop(key, None)
        if data is None:
            data = self._read_once(key, block_hash)
            with self._lock:
                self._prefetched.pop(key, None)  # read by a prefetch meanwhile
        with self._lock:
            if data is None:
                self.stats["disk"].misses += 1
                return None
            self.stats["disk"].hits += 1
            self._put_cpu(key, data, count=False)
        return data

    def holds(self, block_hash: bytes) -> bool:
        """Whether storing this block would add nothing: the CPU tier has it (now most
        recently used), or there is no CPU tier and the disk has it."""
        key = self.key(block_hash)
        with self._lock:
            if key in self._cpu:
                self._cpu.move_to_end(key)
                return True
            return not self.cpu_bytes and (key in self._disk or key in self._pending)

    def on_disk(self, block_hash: bytes) -> bool:
        """Whether the disk tier holds (or is writing) the block, by this engine's index."""
        key = self.key(block_hash)
        with self._lock:
            return key in self._disk or key in self._pending

    def prefetch(self, block_hashes: list[bytes]) -> None:
        """Read these blocks (a prompt's chain, in order) from disk in the background, ahead
        of their lookup; stops at the first block the disk lacks. No-op without a disk tier."""
        if self.disk_dir is not None and block_hashes:
            self._prefetch_queue.put(list(block_hashes))

    def wait_prefetched(self, timeout_s: float = 30.0) -> bool:
        """Wait until the prefetches queued so far are done (tests)."""
        if self.disk_dir is None:
            return True
        done = threading.Event()
        self._prefetch_queue.put(done)
        return done.wait(timeout_s)

    def _prefetch_loop(self) -> None:
        while True:
            item = self._prefetch_queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            for block_hash in item:
                key = self.key(block_hash)
                with self._lock:
                    if key in self._cpu or key in self._pending or key in self._prefetched:
                        continue
                if not os.path.exists(self.path(key)):
                    break
                data = self._read_once(key, block_hash)
                if data is None:
                    break
                with self._lock:
                    self._prefetched[key] = data
                    while len(self._prefetched) * self.geometry.block_bytes > self.prefetch_bytes:
                        self._prefetched.popitem(last=False)

    def _read_once(self, key: bytes, block_hash: bytes) -> np.ndarray | None:
        """``_read_disk``, one reader per key at a time: a second caller waits for the first
        and takes what it found (from the prefetched images or the CPU tier)."""
        while True:
            with self._lock:
                event = self._reading.get(key)
                if event is None:
                    event = self._reading[key] = threading.Event()
                    break
            event.wait()
            with self._lock:
                data = self._prefetched.get(key)
                if data is None:
                    data = self._cpu.get(key)
            if data is not None:
                return data
            if not os.path.exists(self.path(key)):
                return None  # the first reader found it missing or rejected it
        try:
            return self._read_disk(key, block_hash)
        finally:
            with self._lock:
                del self._reading[key]
            event.set()

    # ---- stores (worker side, on the step) ----------------------------------------------

    def store(self, block_hash: bytes, data: np.ndarray) -> None:
        """Keep the image of a block just copied out of the pool: into the CPU tier now,
        onto the disk in the background."""
        assert data.nbytes == self.geometry.block_bytes, (data.nbytes, self.geometry.block_bytes)
        key = self.key(block_hash)
        with self._lock:
            self._put_cpu(key, data, count=True)
            if self.disk_dir is None or key in self._disk or key in self._pending:
                return
            self._pending[key] = data
        self._queue.put((key, block_hash, data))

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until the disk writes queued so far are done; False on timeout."""
        if self._writer is None:
            return True
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout_s)

    def take_stats(self) -> dict[str, dict[str, int]]:
        """Per tier: hits, misses, stores and rejected since the previous call, and bytes now."""
        out: dict[str, dict[str, int]] = {}
        with self._lock:
            self.stats["cpu"].bytes = sum(a.nbytes for a in self._cpu.values())
            self.stats["disk"].bytes = self._disk_total
            for tier in self.enabled_tiers():
                now, before = self.stats[tier], self._reported[tier]
                out[tier] = {name: getattr(now, name) - getattr(before, name)
                             for name in ("hits", "misses", "stores", "rejected")}
                out[tier]["bytes"] = now.bytes
                self._reported[tier] = TierStats(now.hits, now.misses, now.stores, now.rejected)
        return out

    def enabled_tiers(self) -> list[str]:
        return [t for t, on in (("cpu", self.cpu_bytes > 0), ("disk", self.disk_dir is not None)) if on]

    # ---- CPU tier -----------------------------------------------------------------------

    def _put_cpu(self, key: bytes, data: np.ndarray, count: bool) -> None:
        """Insert or refresh under the lock; evict least recently used images past the budget."""
        if self.cpu_bytes < data.nbytes:
            return
        if key in self._cpu:
            self._cpu.move_to_end(key)
            return
        self._cpu[key] = data
        if count:
            self.stats["cpu"].stores += 1
        total = len(self._cpu) * self.geometry.block_bytes
        while total > self.cpu_bytes:
            self._cpu.popitem(last=False)
            total -= self.geometry.block_bytes

    # ---- disk tier ----------------------------------------------------------------------

    def _scan_disk(self) -> None:
        """Index the directory's block files, oldest first (other engines' files included)."""
        entries = []
        stale = time.time() - STALE_TMP_S
        for entry in os.scandir(self.disk_dir):
            if entry.name.endswith(".tmp"):  # a writer died mid-file: never renamed, never read
                try:
                    if entry.stat().st_mtime < stale:
                        os.unlink(entry.path)
                except OSError:
                    pass
                continue
            if entry.name.endswith(SUFFIX) and entry.is_file():
                try:
                    st = entry.stat()
                    entries.append((st.st_mtime_ns, bytes.fromhex(entry.name[: -len(SUFFIX)]), st.st_size))
                except (OSError, ValueError):
                    continue
        for _, key, size in sorted(entries):
            self._disk[key] = size
            self._disk_total += size
        self._trim_disk()

    def _header(self, block_hash: bytes, data: np.ndarray) -> bytes:
        header = {"namespace": self.namespace.hex(), "block_hash": block_hash.hex(),
                  "geometry": self.geometry.to_json(), "payload_bytes": data.nbytes,
                  "crc32": zlib.crc32(memoryview(data).cast("B"))}
        body = json.dumps(header, sort_keys=True).encode()
        return _PREAMBLE.pack(MAGIC, VERSION, len(body)) + body

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            key, block_hash, data = item
            try:
                self._write_file(key, block_hash, data)
            except OSError as e:
                logger.warning("KV offload: cannot write a block to %s: %s", self.disk_dir, e)
            finally:
                with self._lock:
                    self._pending.pop(key, None)

    def _write_file(self, key: bytes, block_hash: bytes, data: np.ndarray) -> None:
        final = self.path(key)
        try:
            size = os.path.getsize(final)  # another engine wrote it: the same bytes
        except FileNotFoundError:
            tmp = f"{final}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
            payload = memoryview(data).cast("B")
            with open(tmp, "wb") as f:
                f.write(self._header(block_hash, data))
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
                size = f.tell()
            os.replace(tmp, final)  # atomic: readers see the whole file or none
        with self._lock:
            if key not in self._disk:
                self._disk[key] = size
                self._disk_total += size
                self.stats["disk"].stores += 1
            self._trim_disk()

    def _trim_disk(self) -> None:
        """Remove least recently used files past the budget (under the lock)."""
        if self.disk_bytes is None:
            return
        while self._disk_total > self.disk_bytes and self._disk:
            key, size = self._disk.popitem(last=False)
            self._disk_total -= size
            try:
                os.unlink(self.path(key))
            except OSError:
                pass  # another engine removed it

    def _reject(self, key: bytes, path: str, why: str) -> None:
        logger.warning("KV offload: skipped %s (%s); the block is recomputed", path, why)
        with self._lock:
            self.stats["disk"].rejected += 1
            size = self._disk.pop(key, None)
            if size is not None:
                self._disk_total -= size
        try:
            os.unlink(path)
        except OSError:
            pass

    def _read_disk(self, key: bytes, block_hash: bytes) -> np.ndarray | None:
        """The checked image of a block file, or None (missing, or rejected and counted)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError:
            return None
        why = self._check(raw, block_hash)
        if isinstance(why, str):
            self._reject(key, path, why)
            return None
        try:
            os.utime(path)  # recently used, for every engine sharing the directory
        except OSError:
            pass
        with self._lock:
            if key in self._disk:
                self._disk.move_to_end(key)
            else:  # written by another engine
                self._disk[key] = len(raw)
                self._disk_total += len(raw)
                self._trim_disk()
        return why

    def _check(self, raw: bytes, block_hash: bytes) -> np.ndarray | str:
        """The payload of a block file, or why it cannot be served."""
        if len(raw) < _PREAMBLE.size:
            return "truncated preamble"
        magic, version, header_len = _PREAMBLE.unpack_from(raw)
        if magic != MAGIC or version != VERSION:
            return "not a pagedllm KV block file of this version"
        start = _PREAMBLE.size + header_len
        try:
            header = json.loads(raw[_PREAMBLE.size:start])
        except (ValueError, UnicodeDecodeError):
            return "unreadable header"
        if not isinstance(header, dict):
            return "unreadable header"
        if header.get("namespace") != self.namespace.hex():
            return "another engine's block (model, weights or version differ)"
        if header.get("geometry") != self.geometry.to_json():
            return f"foreign KV geometry {header.get('geometry')}, this engine's is {self.geometry.to_json()}"
        if header.get("block_hash") != block_hash.hex():
            return "another prefix's block"
        payload = memoryview(raw)[start:]
        if header.get("payload_bytes") != self.geometry.block_bytes or len(payload) != self.geometry.block_bytes:
            return f"truncated payload ({len(payload)} of {self.geometry.block_bytes} bytes)"
        if zlib.crc32(payload) != header.get("crc32"):
            return "checksum mismatch"
        return np.frombuffer(raw, dtype=np.uint8, offset=start)

