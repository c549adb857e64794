"""A few scalar metadata keys of a GGUF file, read from its header without gguf-py.

gguf-py's reader builds every field (the tokenizer's vocabulary one token at a time: seconds),
and a warm start never parses the file (gguf_index.py). This scan reads the key/value section
only, skipping array values by their byte size, and keeps the scalar keys asked for.
"""

from __future__ import annotations

import struct
from typing import BinaryIO

# GGUF value types: id -> struct format of one scalar (8: string, 9: array).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _read(f: BinaryIO, fmt: str) -> int | float | bool:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("the GGUF header ends early")
    return struct.unpack(fmt, data)[0]


def _read_string(f: BinaryIO) -> bytes:
    return f.read(int(_read(f, "<Q")))


def _skip_value(f: BinaryIO, value_type: int) -> None:
    if value_type == _STRING:
        f.seek(int(_read(f, "<Q")), 1)
    elif value_type == _ARRAY:
        item_type, count = int(_read(f, "<I")), int(_read(f, "<Q"))
        if item_type in _SCALAR_FORMATS:
            f.seek(count * struct.calcsize(_SCALAR_FORMATS[item_type]), 1)
        else:
            for _ in range(count):
                _skip_value(f, item_type)
    elif value_type in _SCALAR_FORMATS:
        f.seek(struct.calcsize(_SCALAR_FORMATS[value_type]), 1)
    else:
        raise ValueError(f"unknown GGUF value type {value_type}")


def read_scalar_keys(path: str, prefix: str) -> dict[str, int | float | bool | str]:
    """The scalar (and string) metadata values whose keys start with `prefix`."""
    found: dict[str, int | float | bool | str] = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version = int(_read(f, "<I"))
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or later)")
        _read(f, "<Q")  # tensor count
        for _ in range(int(_read(f, "<Q"))):
            key = _read_string(f).decode("utf-8", "replace")
            value_type = int(_read(f, "<I"))
            if not key.startswith(prefix):
                _skip_value(f, value_type)
            elif value_type == _STRING:
                found[key] = _read_string(f).decode("utf-8", "replace")
            elif value_type in _SCALAR_FORMATS:
                found[key] = _read(f, _SCALAR_FORMATS[value_type])
            else:
                _skip_value(f, value_type)
    return found
