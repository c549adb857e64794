"""KV cache tensors of the paged backend and the pool sizing that goes with them."""

from __future__ import annotations

import logging

import numpy as np
import torch

from pagedllm.config import ModelConfig
from pagedllm.layers.attention import Attention

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def kv_bytes_per_block(model_config: ModelConfig, block_size: int) -> int:
    """Bytes one block occupies across all layers (K and V)."""
    per_token = 2 * model_config.num_kv_heads * model_config.head_dim * _DTYPE_BYTES[model_config.dtype]
    return per_token * model_config.num_layers * block_size


def num_blocks_for_budget(model_config: ModelConfig, block_size: int, memory_bytes: int) -> int:
    """Blocks (including the null block 0) that fit in `memory_bytes`."""
    return memory_bytes // kv_bytes_per_block(model_config, block_size)


def allocate_kv_caches(
    layers: list[Attention], num_blocks: int, block_size: int, dtype: str
) -> list[torch.Tensor]:
    """One [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer, bound to it.

    The pool is one zeroed allocation from numpy, which takes zero pages from the OS lazily:
    start-up does not touch gigabytes, and memory becomes resident as blocks are written.
    Zeros matter: the batched decode path reads (and masks) padding slots, and masked
    garbage could be NaN, which a zero attention weight does not cancel.
    """
    assert layers, "model has no Attention layers"
    shape = (2, num_blocks, block_size, layers[0].num_kv_heads, layers[0].head_dim)
    per_layer = int(np.prod(shape)) * _DTYPE_BYTES[dtype]
    raw = torch.from_numpy(np.zeros(per_layer * len(layers), dtype=np.uint8))
    caches = []
    for i, layer in enumerate(layers):
        assert (layer.num_kv_heads, layer.head_dim) == shape[3:], "layers differ in KV shape"
        cache = raw[i * per_layer : (i + 1) * per_layer].view(TORCH_DTYPES[dtype]).view(shape)
        layer.kv_cache = cache
        caches.append(cache)
    return caches


def copy_blocks(kv_caches: list[torch.Tensor], blocks_to_copy: list[tuple[int, int]]) -> None:
    """Copy-on-write: copy each src block's K and V into dst, in every layer."""
    src = torch.tensor([s for s, _ in blocks_to_copy], dtype=torch.int64)
    dst = torch.tensor([d for _, d in blocks_to_copy], dtype=torch.int64)
    for cache in kv_caches:  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        cache[:, dst] = cache[:, src]
