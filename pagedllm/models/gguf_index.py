"""A GGUF file's tensor table, kept as JSON so a warm start never parses the file's header.

The index is built from the validated headers (gguf_header.py) of the file and of its splits:
the tensor table (name, type, shape, byte offset, which split) and the architecture, plus
each file's path, size and mtime; it is dropped when any of them no longer match. The tensor
data is then read by offset with positional reads of the files (GGUFData).
"""

from __future__ import annotations

import concurrent.futures
import json
import mmap
import os
import re
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import numpy as np

INDEX_FILE = "gguf_index.json"
# GGML types that are floats (kept as float under --quantization gguf); gguf_loader and
# gguf_quant both read it from here.
GGUF_FLOAT_TYPES = ("F32", "F16", "BF16")
_INDEX_VERSION = 2  # 2: splits, each tensor's split


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    type_name: str
    """The GGML type, e.g. "Q4_1" or "F32"."""
    dims: tuple[int, ...]
    """GGUF order: fastest-varying dimension first (the reverse of HF's shapes)."""
    offset: int
    """Absolute byte offset of the tensor's data in the file."""
    dtype: str
    """numpy dtype of the raw data: the element type, or uint8 for quantized blocks."""
    data_shape: tuple[int, ...]
    """Shape of the raw data as gguf-py gives it: HF order, the last axis in bytes per row
    for quantized types."""
    split: int = 0
    """Which file of a split model holds it (0: the first, `GGUFIndex.path`)."""

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape in HF order."""
        return tuple(reversed(self.dims))

    @property
    def num_bytes(self) -> int:
        return int(np.prod(self.data_shape)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class GGUFIndex:
    path: str
    """The file's real path."""
    size: int
    mtime_ns: int
    architecture: str
    """general.architecture, e.g. "llama"."""
    tensors: tuple[GGUFTensorInfo, ...]
    splits: tuple[tuple[str, int, int], ...] = ()
    """The further files of a split model (`-00002-of-00003.gguf`, ...): (real path, size,
    mtime_ns) each; the first file is `path` and holds the metadata."""

    @property
    def file_bytes(self) -> int:
        """The size of the model's file(s)."""
        return self.size + sum(s[1] for s in self.splits)

    def type_names(self, ndim: int | None = None) -> set[str]:
        """The GGML types of the tensors (of `ndim` dimensions, if given)."""
        return {t.type_name for t in self.tensors if ndim is None or len(t.dims) == ndim}

    def matches_file(self) -> bool:
        """True while the file at `path` has the size and mtime this index was built from."""
        for path, size, mtime_ns in ((self.path, self.size, self.mtime_ns), *self.splits):
            try:
                st = os.stat(path)
            except OSError:
                return False
            if (st.st_size, st.st_mtime_ns) != (size, mtime_ns):
                return False
        return True

    def open_data(self) -> list[GGUFData]:
        """Each file's tensor data (the first, then the splits), read with `tensor_data`."""
        paths = [self.path, *(s[0] for s in self.splits)]
        return [GGUFData(p) for p in paths]


class GGUFData:
    """A GGUF file read by offset with positional reads (os.pread), not a memory map: the bytes
    land straight in the array that keeps them, and the file's pages stay in the page cache
    instead of counting in the process's resident set while the model loads (a map's touched
    pages do: a 0.75 GiB file peaked at 2.5x its size in RSS)."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            self.size = os.fstat(f.fileno()).st_size

    def read(self, offset: int, num_bytes: int) -> np.ndarray:
        """uint8 [num_bytes] at `offset`; ValueError past the end of the file."""
        if offset < 0 or offset + num_bytes > self.size:
            raise ValueError(f"{self.path}: bytes [{offset}, {offset + num_bytes}) are past the file's end ({self.size})")
        out = _prefaulted(num_bytes)
        view = memoryview(out)
        with open(self.path, "rb", buffering=0) as f:
            done = 0
            while done < num_bytes:  # preadv may return short counts (signals, > 2 GiB)
                n = os.preadv(f.fileno(), [view[done : done + (1 << 30)]], offset + done)
                if n <= 0:
                    raise ValueError(f"{self.path}: the file ended at byte {offset + done} while reading a tensor")
                done += n
        return out


_PREFAULT_MIN_BYTES = 1 << 20


def _prefaulted(num_bytes: int) -> np.ndarray:
    """uint8 [num_bytes], its pages mapped up front (MAP_POPULATE) where the OS has it: the
    positional read then copies into memory that is already there instead of taking a page
    fault every 4 KiB (measured ~2x faster reading an 8B model's tensors from the page
    cache). The array owns its mapping (freed with it)."""
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if num_bytes < _PREFAULT_MIN_BYTES or not populate:
        return np.empty(num_bytes, dtype=np.uint8)
    region = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
    return np.frombuffer(region, dtype=np.uint8)


def tensor_data(files: list[GGUFData], tensor: GGUFTensorInfo) -> np.ndarray:
    """A tensor's raw data (read into an array of its own), shaped as gguf-py's `t.data`."""
    file = files[tensor.split]
    end = tensor.offset + tensor.num_bytes
    if end > file.size:
        raise ValueError(f"GGUF tensor {tensor.name} ends at byte {end}, past the file's end")
    return file.read(tensor.offset, tensor.num_bytes).view(np.dtype(tensor.dtype)).reshape(tensor.data_shape)


READ_AHEAD_MAX_BYTES = 256 << 20
"""The largest tensor read ahead of its turn (layers' matrices are; an 8B model's embedding
table and head, 0.3-0.6 GB, are read in turn, so the peak RSS grows by one layer matrix)."""


def read_ahead(files: list[GGUFData], tensors: list[GGUFTensorInfo]) -> Iterator[tuple[GGUFTensorInfo, np.ndarray]]:
    """(tensor, tensor_data) for each tensor in order, the next one's read (a positional
    read, which releases the GIL) running on a second thread while the caller converts the
    current one: a load is reading and converting at once instead of in turn."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gguf-read") as pool:
        pending: concurrent.futures.Future[np.ndarray] | None = None
        for i, t in enumerate(tensors):
            data = pending.result() if pending is not None else tensor_data(files, t)
            pending = None
            following = tensors[i + 1] if i + 1 < len(tensors) else None
            if following is not None and following.num_bytes <= READ_AHEAD_MAX_BYTES:
                pending = pool.submit(tensor_data, files, following)
            yield t, data


# gguf-py's numpy dtypes of the plain types; every other type is uint8 blocks.
_PLAIN_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "|i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}
_SPLIT_RE = re.compile(r"(.*)-(\d{5})-of-(\d{5})\.gguf")


def split_paths(gguf_path: str) -> list[str]:
    """The files of a model: [gguf_path], or every `-0000i-of-0000n.gguf` beside the first
    split; ValueError naming a missing one."""
    m = _SPLIT_RE.fullmatch(gguf_path)
    if m is None:
        return [gguf_path]
    count = int(m.group(3))
    if int(m.group(2)) != 1 or count < 1:
        raise ValueError(
            f"{gguf_path} is split {m.group(2)} of {m.group(3)}: load the first split, -00001-of-{m.group(3)}.gguf"
        )
    paths = [f"{m.group(1)}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"{gguf_path} is split in {count} files; missing: {', '.join(missing)}")
    return paths


def index_from_headers(gguf_path: str) -> GGUFIndex:
    """The index of a file (and its splits) from their validated headers (gguf_header.py)."""
    from pagedllm.models.gguf_header import read_gguf_header

    paths = [os.path.realpath(p) for p in split_paths(gguf_path)]
    tensors: list[GGUFTensorInfo] = []
    seen: set[str] = set()
    arch: object = None
    for split, path in enumerate(paths):
        header = read_gguf_header(path)
        if split == 0:
            arch = header.metadata.get("general.architecture")
            if not isinstance(arch, str):
                raise ValueError(f"{gguf_path}: not a valid GGUF file: no general.architecture string")
        for t in header.tensors:
            if t.name in seen:
                raise ValueError(f"{gguf_path}: not a valid GGUF file: tensor {t.name!r} appears twice")
            seen.add(t.name)
            tensors.append(_tensor_info(t, split))
    stats = [os.stat(p) for p in paths]
    splits = tuple((p, st.st_size, st.st_mtime_ns) for p, st in zip(paths[1:], stats[1:]))
    return GGUFIndex(paths[0], stats[0].st_size, stats[0].st_mtime_ns, str(arch), tuple(tensors), splits)


def _tensor_info(t: Any, split: int) -> GGUFTensorInfo:
    shape = tuple(reversed(t.dims))
    dtype = _PLAIN_DTYPES.get(t.type_name)
    if dtype is None:  # blocks: rows of bytes
        data_shape = (*shape[:-1], t.num_bytes // max(1, _rows(shape)))
        dtype = "|u1"
    else:
        data_shape = shape
    return GGUFTensorInfo(t.name, t.type_name, tuple(t.dims), t.offset, dtype, data_shape, split)


def _rows(shape: tuple[int, ...]) -> int:
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows


def save_index(index: GGUFIndex, directory: str) -> None:
    """Write the index into `directory` (atomically: readers see all of it or none)."""
    target = os.path.join(directory, INDEX_FILE)
    tmp = f"{target}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"version": _INDEX_VERSION, **asdict(index)}, f)
    os.replace(tmp, target)


def load_index(directory: str, gguf_path: str) -> GGUFIndex | None:
    """The index saved in `directory` for this file, or None if there is none, it is of
    another format, or the file changed (path, size or mtime) since it was written."""
    try:
        with open(os.path.join(directory, INDEX_FILE)) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    if raw.pop("version", None) != _INDEX_VERSION:
        return None
    try:
        tensors = tuple(
            GGUFTensorInfo(**(t | {"dims": tuple(t["dims"]), "data_shape": tuple(t["data_shape"])}))
            for t in raw.pop("tensors")
        )
        splits = tuple(tuple(s) for s in raw.pop("splits"))
        index = GGUFIndex(**raw, tensors=tensors, splits=splits)  # type: ignore[arg-type]
    except (KeyError, TypeError):
        return None
    if index.path != os.path.realpath(gguf_path) or not index.matches_file():
        return None
    return index
