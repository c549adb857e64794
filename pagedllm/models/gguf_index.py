"""A GGUF file's tensor table, kept as JSON so a warm start never parses the file's metadata.

gguf-py's reader builds every metadata field as numpy views, one token at a time for the
tokenizer's vocabulary: seconds for a 49k vocabulary, and a load needs only the tensor table
(name, type, shape, byte offset) and the architecture. The index records those, plus the
file's path, size and mtime, and is dropped when any of them no longer match. The tensor data
is then read by offset from a read-only memory map of the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

INDEX_FILE = "gguf_index.json"
# GGML types that are floats (kept as float under --quantization gguf); gguf_loader and
# gguf_quant both read it from here.
GGUF_FLOAT_TYPES = ("F32", "F16", "BF16")
_INDEX_VERSION = 1


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

    def type_names(self, ndim: int | None = None) -> set[str]:
        """The GGML types of the tensors (of `ndim` dimensions, if given)."""
        return {t.type_name for t in self.tensors if ndim is None or len(t.dims) == ndim}

    def matches_file(self) -> bool:
        """True while the file at `path` has the size and mtime this index was built from."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_size, st.st_mtime_ns) == (self.size, self.mtime_ns)

    def open_data(self) -> np.ndarray:
        """The whole file as a read-only uint8 memory map; slice it with `tensor_data`."""
        return np.memmap(self.path, dtype=np.uint8, mode="r")


def tensor_data(file_map: np.ndarray, tensor: GGUFTensorInfo) -> np.ndarray:
    """A tensor's raw data (a view into the map, no copy), shaped as gguf-py's `t.data`."""
    end = tensor.offset + tensor.num_bytes
    if end > file_map.shape[0]:
        raise ValueError(f"GGUF tensor {tensor.name} ends at byte {end}, past the file's end")
    return file_map[tensor.offset : end].view(np.dtype(tensor.dtype)).reshape(tensor.data_shape)


def index_from_reader(reader: Any, gguf_path: str) -> GGUFIndex:
    """The index of a file parsed by gguf-py's GGUFReader."""
    path = os.path.realpath(gguf_path)
    st = os.stat(path)
    tensors = tuple(
        GGUFTensorInfo(
            name=t.name,
            type_name=t.tensor_type.name,
            dims=tuple(int(d) for d in t.shape.tolist()),
            offset=int(t.data_offset),
            dtype=t.data.dtype.str,
            data_shape=tuple(int(d) for d in t.data.shape),
        )
        for t in reader.tensors
    )
    arch = str(reader.fields["general.architecture"].contents())
    return GGUFIndex(path, st.st_size, st.st_mtime_ns, arch, tensors)


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
        index = GGUFIndex(**raw, tensors=tensors)
    except (KeyError, TypeError):
        return None
    if index.path != os.path.realpath(gguf_path) or not index.matches_file():
        return None
    return index
