"""Prefix hashing: chained, canonical, stable across processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.kv_backends.paged.kv_cache_utils import (
    NONE_HASH,
    extend_block_hashes,
    first_block_extra_keys,
    hash_block_tokens,
    hash_request_tokens,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
TOKENS = list(range(1000, 1010))  # two full blocks of 4 and a partial one
EXTRA = first_block_extra_keys(("m", "float32", 4), "salt")


def test_hash_is_sha256_over_parent_chain() -> None:
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert len(h0) == 32
    assert h0 == hash_block_tokens(NONE_HASH, [1, 2, 3, 4])  # None means the fixed root
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    assert hash_request_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [h0, h1]
    # The same tokens under a different parent are a different prefix.
    assert hash_block_tokens(None, [5, 6, 7, 8]) != h1


def test_hash_changes_with_any_token_of_any_earlier_block() -> None:
    tokens = list(range(16))
    base = hash_request_tokens(tokens, 4)
    for pos in range(12):  # every token of blocks 0..2 changes the hash of block 3
        changed = list(tokens)
        changed[pos] += 1
        hashes = hash_request_tokens(changed, 4)
        assert hashes[3] != base[3], pos
        assert hashes[: pos // 4] == base[: pos // 4]  # blocks before it are unaffected


def test_extra_keys_and_encoding_are_unambiguous() -> None:
    assert hash_block_tokens(None, [1, 2], ("a",)) != hash_block_tokens(None, [1, 2], None)
    assert hash_block_tokens(None, [1, 2], ("a", "b")) != hash_block_tokens(None, [1, 2], ("ab",))
    assert hash_block_tokens(None, [1, 2], (1,)) != hash_block_tokens(None, [1, 2], ("1",))
    assert hash_block_tokens(None, [1, 2], (True,)) != hash_block_tokens(None, [1, 2], (1,))
    assert hash_block_tokens(None, [1, 2], ((1, 2),)) != hash_block_tokens(None, [1, 2], (1, 2))
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2, 0])
    with pytest.raises(TypeError, match="stable"):
        hash_block_tokens(None, [1], (object(),))


def test_cache_salt_and_engine_keys_go_into_the_first_block_only() -> None:
    assert first_block_extra_keys((), None) is None
    salted = hash_request_tokens(TOKENS, 4, first_block_extra_keys((), "a"))
    other = hash_request_tokens(TOKENS, 4, first_block_extra_keys((), "b"))
    plain = hash_request_tokens(TOKENS, 4)
    assert len({salted[0], other[0], plain[0]}) == 3
    assert len({salted[1], other[1], plain[1]}) == 3  # the chain carries it on
    assert salted[1] == hash_block_tokens(salted[0], TOKENS[4:8])  # no extra keys after block 0


def test_extend_block_hashes_is_incremental() -> None:
    tokens = list(range(50, 80))
    full = hash_request_tokens(tokens, 4, EXTRA)
    hashes: list[bytes] = []
    for n in range(len(tokens) + 1):  # as if one token were appended at a time
        extend_block_hashes(hashes, tokens[:n], 4, EXTRA)
        assert hashes == full[: n // 4]
    assert len(hashes) == 7  # 30 tokens: 7 full blocks, the partial one is not hashed


# Runs without pagedllm/__init__.py (which loads the torch-based engine) and with torch made
# unimportable: the control plane must work without torch, and this keeps the subprocess fast.
_SUBPROCESS_PRELUDE = """
import sys, types
sys.modules["torch"] = None
pkg = types.ModuleType("pagedllm")
pkg.__path__ = ["pagedllm"]
sys.modules["pagedllm"] = pkg
import pagedllm.core.scheduler
"""


def test_hashes_agree_across_processes_without_torch() -> None:
    code = _SUBPROCESS_PRELUDE + (
        "from pagedllm.kv_backends.paged.kv_cache_utils import first_block_extra_keys, hash_request_tokens\n"
        "extra = first_block_extra_keys(('m', 'float32', 4), 'salt')\n"
        f"print(','.join(h.hex() for h in hash_request_tokens({TOKENS!r}, 4, extra)))\n"
    )
    expected = ",".join(h.hex() for h in hash_request_tokens(TOKENS, 4, EXTRA))
    for seed in ("0", "12345"):  # Python's own hash() differs between these; ours must not
        result = subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO_ROOT,
            env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == expected
