"""Prompt prefixes saved by name (``/v1/kv/save``, ``/v1/kv/restore``; docs/kv_offload.md):
one file per name under ``<kv_offload_dir>/saved/``, holding the prefix's blocks with a
checksum each, written atomically as the disk tier's block files (offload.py)."""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
import zlib

import numpy as np

from pagedllm.kv_backends.paged.offload import _PREAMBLE, MAGIC, VERSION, OffloadStore

logger = logging.getLogger(__name__)

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
SAVED_SUFFIX = ".kvs"


def saved_path(store: OffloadStore, name: str) -> str:
    """Where the prefix saved as ``name`` lives: ``<kv_offload_dir>/saved/<name>.kvs``."""
    if store.disk_dir is None:
        raise ValueError("saving and restoring KV by name needs a disk tier (--kv-offload-dir)")
    if not re.fullmatch(NAME_PATTERN, name):
        raise ValueError(
            f"name={name!r} must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return os.path.join(store.disk_dir, "saved", name + SAVED_SUFFIX)


def write_saved(store: OffloadStore, path: str, block_hashes: list[bytes], images: list[np.ndarray],
                token_ids: list[int]) -> None:
    """One file holding a prefix's blocks (written atomically, as the block files)."""
    header = {"namespace": store.namespace.hex(), "geometry": store.geometry.to_json(),
              "block_hashes": [h.hex() for h in block_hashes], "token_ids": token_ids,
              "crc32": [zlib.crc32(memoryview(image).cast("B")) for image in images]}
    body = json.dumps(header).encode()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "wb") as f:
        f.write(_PREAMBLE.pack(MAGIC, VERSION, len(body)) + body)
        for image in images:
            f.write(memoryview(image).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_saved(store: OffloadStore, path: str) -> tuple[list[bytes], list[np.ndarray]]:
    """The blocks of a saved prefix, up to the first that fails its checksum; ValueError when
    the file is missing, unreadable or another engine's."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ValueError(f"no KV saved under the name {os.path.basename(path)[:-len(SAVED_SUFFIX)]!r}") from None
    if len(raw) < _PREAMBLE.size:
        raise ValueError("the saved KV file is truncated")
    magic, version, header_len = _PREAMBLE.unpack_from(raw)
    try:
        header = json.loads(raw[_PREAMBLE.size:_PREAMBLE.size + header_len])
    except (ValueError, UnicodeDecodeError):
        header = None
    if magic != MAGIC or version != VERSION or not isinstance(header, dict):
        raise ValueError("the saved KV file is not a pagedllm KV file of this version")
    if header.get("namespace") != store.namespace.hex() or header.get("geometry") != store.geometry.to_json():
        raise ValueError("the saved KV belongs to another model, weights, dtype or KV layout")
    size = store.geometry.block_bytes
    offset = _PREAMBLE.size + header_len
    hashes, images = [], []
    for i, (h, crc) in enumerate(zip(header["block_hashes"], header["crc32"])):
        payload = memoryview(raw)[offset + i * size: offset + (i + 1) * size]
        if len(payload) != size or zlib.crc32(payload) != crc:
            with store._lock:
                store.stats["disk"].rejected += 1
            logger.warning("KV offload: %s: block %d fails its checksum; restoring the %d before it", path, i, i)
            break
        hashes.append(bytes.fromhex(h))
        images.append(np.frombuffer(raw, dtype=np.uint8, count=size, offset=offset + i * size))
    return hashes, images
