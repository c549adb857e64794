"""Images in the prefix-cache hashes (multimodal/inputs.py::mm_block_keys), model-free: blocks
before an image hash like text, from the image's first block on the image's hash chains in."""

from __future__ import annotations

import numpy as np

from pagedllm.kv_backends.paged.kv_cache_utils import extend_block_hashes, hash_request_tokens
from pagedllm.multimodal.inputs import MultiModalFeature, mm_block_keys

BLOCK = 4
TOKENS = list(range(100, 124))  # 6 blocks


def _feature(identifier: str, start: int, n: int) -> MultiModalFeature:
    return MultiModalFeature(identifier, np.arange(start, start + n), np.zeros((1, 3, 2, 2), np.float32))


def _hashes(features):
    out: list[bytes] = []
    extend_block_hashes(out, TOKENS, BLOCK, None, mm_block_keys(features, BLOCK))
    return out


def test_blocks_before_the_image_share_and_the_rest_do_not():
    a = _hashes([_feature("aaa", 9, 6)])  # positions 9..14: blocks 2 and 3
    b = _hashes([_feature("bbb", 9, 6)])
    text = hash_request_tokens(TOKENS, BLOCK)
    assert a[:2] == b[:2] == text[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:]))
    assert a == _hashes([_feature("aaa", 9, 6)])  # stable


def test_keys_name_every_overlapping_image():
    keys = mm_block_keys([_feature("x", 3, 2), _feature("y", 5, 4)], BLOCK)
    assert keys == {0: ("mm", (("x", 3),)), 1: ("mm", (("x", 3), ("y", 5))), 2: ("mm", (("y", 5),))}
    assert mm_block_keys(None, BLOCK) is None and mm_block_keys([], BLOCK) is None
