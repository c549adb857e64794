"""KV cache tensors of the paged backend, the KV cache groups, and the pool sizing.

Layers with the same attention type (full, or one sliding window) form KV cache groups;
each group has its own block ids per request (core/kv_cache_manager.py). Every group has
the same number of layers (the gcd of the per-type layer counts: Gemma 3 270M's 3 global and
15 local layers make 1 + 5 groups of 3), so that groups can share the block pool and the
tensors: tensor j holds the j-th layer of every group, and a block id, owned by one group at
a time, addresses one slice in each of that group's layers' tensors with none left idle.
A model with one attention type has one group and one tensor per layer, as before.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.layers.attention import Attention

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class KVCacheGroup(NamedTuple):
    sliding_window: int | None
    """The group's window, None for full attention."""
    layer_indices: list[int]
    """Positions of its layers in the model's list of Attention layers."""


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def kv_cache_groups(layers: list[Attention]) -> list[KVCacheGroup]:
    """Equal-sized groups of layers of one attention type: full attention first, then
    windows ascending, each type split into runs of `num_layer_slots` layers."""
    windows = sorted({layer.sliding_window for layer in layers}, key=lambda w: (w is not None, w or 0))
    by_type = {w: [i for i, layer in enumerate(layers) if layer.sliding_window == w] for w in windows}
    size = math.gcd(*(len(indices) for indices in by_type.values()))
    return [
        KVCacheGroup(w, indices[start : start + size])
        for w, indices in by_type.items()
        for start in range(0, len(indices), size)
    ]


def num_layer_slots(layers: list[Attention]) -> int:
    """Layer-sized slices one block spans: the (common) size of the groups."""
    return len(kv_cache_groups(layers)[0].layer_indices)


def kv_bytes_per_block(model_config: ModelConfig, block_size: int, num_layers: int | None = None) -> int:
    """Bytes one block occupies over `num_layers` layers (default: all of them), K and V."""
    per_token = 2 * model_config.num_kv_heads * model_config.head_dim * _DTYPE_BYTES[model_config.dtype]
    return per_token * (num_layers or model_config.num_layers) * block_size


def num_blocks_for_budget(
    model_config: ModelConfig, block_size: int, memory_bytes: int, num_layers: int | None = None
) -> int:
    """Blocks (including the null block 0) that fit in `memory_bytes`."""
    return memory_bytes // kv_bytes_per_block(model_config, block_size, num_layers)


def allocate_kv_caches(
    layers: list[Attention], num_blocks: int, block_size: int, dtype: str
) -> list[torch.Tensor]:
    """[2, num_blocks, block_size, num_kv_heads, head_dim] tensors, bound to the layers with
    each layer's group index; one tensor per layer slot (see the module docstring).

    The pool is one zeroed allocation from numpy, which takes zero pages from the OS lazily:
    start-up does not touch gigabytes, and memory becomes resident as blocks are written.
    Zeros matter: the batched decode path reads (and masks) padding slots, and masked
    garbage could be NaN, which a zero attention weight does not cancel.
    """
    assert layers, "model has no Attention layers"
    shape = (2, num_blocks, block_size, layers[0].num_kv_heads, layers[0].head_dim)
    per_layer = int(np.prod(shape)) * _DTYPE_BYTES[dtype]
    num_slots = num_layer_slots(layers)
    raw = torch.from_numpy(np.zeros(per_layer * num_slots, dtype=np.uint8))
    caches = [
        raw[i * per_layer : (i + 1) * per_layer].view(TORCH_DTYPES[dtype]).view(shape)
        for i in range(num_slots)
    ]
    for group_id, group in enumerate(kv_cache_groups(layers)):
        for slot, layer_index in enumerate(group.layer_indices):
            layer = layers[layer_index]
            assert (layer.num_kv_heads, layer.head_dim) == shape[3:], "layers differ in KV shape"
            layer.kv_cache = caches[slot]
            layer.kv_cache_group = group_id
    return caches


def copy_blocks(kv_caches: list[torch.Tensor], blocks_to_copy: list[tuple[int, int]]) -> None:
    """Copy-on-write: copy each src block's K and V into dst, in every layer."""
    src = torch.tensor([s for s, _ in blocks_to_copy], dtype=torch.int64)
    dst = torch.tensor([d for _, d in blocks_to_copy], dtype=torch.int64)
    for cache in kv_caches:  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        cache[:, dst] = cache[:, src]
