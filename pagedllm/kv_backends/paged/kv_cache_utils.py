"""Prefix-cache hashing: a stable hash per full KV block, chained through its parent.

The hash of block ``i`` covers the hash of block ``i - 1`` (its parent), the block's token ids
and optional extra keys, so equal hashes mean equal *prefixes*, not just equal blocks. The
encoding is canonical (type-tagged, length-prefixed, little-endian) and the digest is sha256,
so the same prefix hashes alike in every process and on every machine: nothing here depends on
Python's salted ``hash()``, on dict order or on the platform's byte order.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence

BlockHash = bytes
"""A 32-byte sha256 digest naming a full block and everything before it."""

NONE_HASH: BlockHash = hashlib.sha256(b"pagedllm/prefix-cache/root/v1").digest()
"""The parent of every request's first block. Fixed (unlike vLLM's random default) so that
hashes agree across processes, e.g. between a prefill and a decode instance."""


def _encode(value: object, out: bytearray) -> None:
    """Append a canonical, type-tagged encoding of ``value`` to ``out``.

    Every variable-length item is length-prefixed, so no two different values encode alike.
    """
    if value is None:
        out += b"N"
    elif isinstance(value, bool):  # before int: bool is a subclass of int
        out += b"T" if value else b"F"
    elif isinstance(value, int):
        # Arbitrary-size ints as signed little-endian bytes, length-prefixed.
        size = (value.bit_length() + 8) // 8
        out += b"i" + struct.pack("<I", size) + value.to_bytes(size, "little", signed=True)
    elif isinstance(value, float):
        out += b"f" + struct.pack("<d", value)
    elif isinstance(value, str):
        data = value.encode("utf-8")
        out += b"s" + struct.pack("<I", len(data)) + data
    elif isinstance(value, (bytes, bytearray)):
        out += b"b" + struct.pack("<I", len(value)) + bytes(value)
    elif isinstance(value, (tuple, list)):
        out += b"t" + struct.pack("<I", len(value))
        for item in value:
            _encode(item, out)
    else:
        raise TypeError(
            f"prefix-cache extra key {value!r} of type {type(value).__name__} has no stable "
            "encoding; use None, bool, int, float, str, bytes or tuples of them"
        )


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> BlockHash:
    """sha256 over (parent hash, token ids, extra keys), canonically encoded.

    ``parent_hash`` is None for a request's first block (the fixed ``NONE_HASH`` is used).
    Token ids must be non-negative and below 2**32 (every vocabulary is far smaller).
    """
    buf = bytearray(NONE_HASH if parent_hash is None else parent_hash)
    buf += struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids)
    _encode(extra_keys, buf)
    return hashlib.sha256(buf).digest()


def first_block_extra_keys(
    engine_keys: tuple, cache_salt: str | None, lora_key: tuple | None = None
) -> tuple | None:
    """Extra keys of a request's first block: the engine-wide keys, the request's salt and its
    LoRA adapter (``LoRARequest.cache_key()``).

    Only the first block needs them: every later hash chains through it.
    """
    keys = engine_keys
    if cache_salt is not None:
        keys = (*keys, ("cache_salt", cache_salt))
    if lora_key is not None:
        keys = (*keys, lora_key)
    return keys or None


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    first_extra_keys: tuple | None = None,
    block_extra_keys: Mapping[int, tuple] | None = None,
) -> None:
    """Append to ``block_hashes`` the hashes of the full blocks of ``token_ids`` not yet hashed.
    ``block_extra_keys``: more keys of some blocks by index (the images a block holds:
    ``multimodal.inputs.mm_block_keys``); every later hash chains through them.

    Incremental: blocks ``0 .. len(block_hashes) - 1`` are taken as already hashed (the token
    ids of a full block never change), so calling this after every appended token costs one
    sha256 per newly full block. A trailing partial block is never hashed.
    """
    start = len(block_hashes)
    num_full = len(token_ids) // block_size
    parent = block_hashes[-1] if block_hashes else None
    for i in range(start, num_full):
        extra = first_extra_keys if i == 0 else None
        if block_extra_keys is not None and i in block_extra_keys:
            extra = (*(extra or ()), block_extra_keys[i])
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        block_hashes.append(parent)


def hash_request_tokens(
    token_ids: Sequence[int],
    block_size: int,
    first_extra_keys: tuple | None = None,
) -> list[BlockHash]:
    """The hashes of every full block of ``token_ids`` (a convenience over the above)."""
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, token_ids, block_size, first_extra_keys)
    return hashes
