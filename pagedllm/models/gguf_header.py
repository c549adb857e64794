"""A GGUF file's header, parsed and validated before anything else trusts it.

A GGUF is input from the internet. Every length, count, type, shape and offset in its header
is checked against the file before it is used, so a truncated or crafted file is a ValueError
naming the field, never a crash, a hang or an allocation of a claimed size:
- magic "GGUF", version 2 or 3 (little-endian);
- a string's or an array's claimed length fits in the bytes left in the file (a "string of
  gigabytes" is refused before any read), arrays nest at most _MAX_ARRAY_DEPTH deep;
- value types and tensor types are known ids;
- a tensor has 1-4 dimensions, each >= 1, whose element count stays below 2^62 and whose
  first dimension is whole blocks of its type; names are unique and at most _MAX_NAME bytes;
- `general.alignment` is a power of two; each tensor's data is aligned and lies inside the
  file.
Only the metadata scalars and strings are kept (arrays are skipped, their sizes checked).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

GGUF_MAGIC = b"GGUF"
_MAX_DIMS = 4
_MAX_NAME = 1024
_MAX_ARRAY_DEPTH = 2
_MAX_ELEMENTS = 1 << 62
_DEFAULT_ALIGNMENT = 32

# GGUF value types: id -> struct format of one scalar (8: string, 9: array).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class HeaderTensor:
    name: str
    type_name: str
    """The ggml type, e.g. "Q4_K"."""
    dims: tuple[int, ...]
    """GGUF order: fastest-varying dimension first."""
    offset: int
    """Absolute byte offset of the data in the file."""
    num_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, int | float | bool | str]
    """The scalar and string values (arrays are skipped)."""
    tensors: tuple[HeaderTensor, ...]
    data_offset: int
    """Where the tensor data starts (aligned)."""
    file_size: int


def ggml_types() -> dict[int, tuple[str, int, int]]:
    """ggml type id -> (name, elements per block, bytes per block), from gguf-py's tables."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return {int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in GGMLQuantizationType if t in GGML_QUANT_SIZES}


class _Reader:
    """Bounded reads: every read and skip is checked against the file's size first."""

    def __init__(self, f: BinaryIO, size: int, path: str) -> None:
        self.f, self.size, self.path = f, size, path

    def left(self) -> int:
        return self.size - self.f.tell()

    def fail(self, what: str) -> ValueError:
        return ValueError(f"{self.path}: not a valid GGUF file: {what} (at byte {self.f.tell()})")

    def take(self, n: int, what: str) -> bytes:
        if n > self.left():
            raise self.fail(f"{what} claims {n} bytes, {self.left()} are left in the file")
        return self.f.read(n)

    def skip(self, n: int, what: str) -> None:
        if n > self.left():
            raise self.fail(f"{what} claims {n} bytes, {self.left()} are left in the file")
        self.f.seek(n, os.SEEK_CUR)

    def scalar(self, fmt: str, what: str) -> int | float | bool:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def u32(self, what: str) -> int:
        return int(self.scalar("<I", what))

    def u64(self, what: str) -> int:
        return int(self.scalar("<Q", what))

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.u64(f"{what}'s length")
        if limit is not None and n > limit:
            raise self.fail(f"{what} is {n} bytes long (at most {limit})")
        return self.take(n, what).decode("utf-8", "replace")

    def value(self, value_type: int, what: str, depth: int = 0) -> int | float | bool | str | None:
        """A scalar or string value; arrays are skipped (None) with their sizes checked."""
        if value_type in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[value_type], what)
        if value_type == _STRING:
            return self.string(what)
        if value_type != _ARRAY:
            raise self.fail(f"{what} has unknown value type {value_type}")
        if depth >= _MAX_ARRAY_DEPTH:
            raise self.fail(f"{what} nests arrays deeper than {_MAX_ARRAY_DEPTH}")
        item_type, count = self.u32(f"{what}'s item type"), self.u64(f"{what}'s length")
        if item_type in _SCALAR_FORMATS:
            self.skip(count * struct.calcsize(_SCALAR_FORMATS[item_type]), what)
            return None
        if item_type not in (_STRING, _ARRAY):
            raise self.fail(f"{what} has items of unknown value type {item_type}")
        if count * 8 > self.left():  # each string or array item takes at least 8 bytes
            raise self.fail(f"{what} claims {count} items, more than the file holds")
        for _ in range(count):
            if item_type == _STRING:
                self.skip(self.u64(f"an item of {what}"), f"an item of {what}")
            else:
                self.value(_ARRAY, f"an item of {what}", depth + 1)
        return None


def read_gguf_header(path: str) -> GGUFHeader:
    """The validated header of the GGUF file at `path`; ValueError naming what is wrong."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        r = _Reader(f, size, path)
        if size < 24 or r.take(4, "the magic") != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic, or shorter than a GGUF header)")
        version = r.u32("the version")
        if version not in (2, 3):
            raise r.fail(f"GGUF version {version} is not supported (2 or 3, little-endian)")
        num_tensors, num_kv = r.u64("the tensor count"), r.u64("the metadata count")
        if num_kv * 12 > r.left() or num_tensors * 24 > r.left():
            raise r.fail(f"{num_kv} metadata entries and {num_tensors} tensors cannot fit in the file")
        metadata: dict[str, int | float | bool | str] = {}
        for _ in range(num_kv):
            key = r.string("a metadata key", _MAX_NAME)
            value = r.value(r.u32(f"{key}'s type"), key)
            if value is not None:
                metadata[key] = value
        types = ggml_types()
        infos = [_tensor_info(r, types) for _ in range(num_tensors)]
        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
            raise r.fail(f"general.alignment={alignment!r} is not a power of two")
        data_offset = -(-f.tell() // alignment) * alignment
    tensors: list[HeaderTensor] = []
    names: set[str] = set()
    for name, type_name, dims, relative, num_bytes in infos:
        if name in names:
            raise ValueError(f"{path}: not a valid GGUF file: tensor {name!r} appears twice")
        names.add(name)
        start = data_offset + relative
        if relative % alignment or start + num_bytes > size:
            raise ValueError(
                f"{path}: not a valid GGUF file: tensor {name!r} ({num_bytes} bytes at offset {relative}) "
                f"is {'unaligned' if relative % alignment else 'past the end of the file'} ({size} bytes)"
            )
        tensors.append(HeaderTensor(name, type_name, dims, start, num_bytes))
    return GGUFHeader(version, metadata, tuple(tensors), data_offset, size)


def _tensor_info(r: _Reader, types: dict[int, tuple[str, int, int]]) -> tuple[str, str, tuple[int, ...], int, int]:
    name = r.string("a tensor name", _MAX_NAME)
    n_dims = r.u32(f"tensor {name!r}'s dimension count")
    if not 1 <= n_dims <= _MAX_DIMS:
        raise r.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {_MAX_DIMS})")
    dims = tuple(r.u64(f"tensor {name!r}'s shape") for _ in range(n_dims))
    type_id = r.u32(f"tensor {name!r}'s type")
    offset = r.u64(f"tensor {name!r}'s offset")
    if type_id not in types:
        raise r.fail(f"tensor {name!r} has unknown ggml type {type_id}")
    type_name, block_elems, block_bytes = types[type_id]
    elements = 1
    for d in dims:
        elements *= d
    if min(dims) < 1 or elements >= _MAX_ELEMENTS:
        raise r.fail(f"tensor {name!r} has shape {list(dims)}: {elements} elements")
    if dims[0] % block_elems:
        raise r.fail(f"tensor {name!r}'s rows of {dims[0]} are not whole {type_name} blocks of {block_elems}")
    return name, type_name, dims, offset, elements // block_elems * block_bytes
