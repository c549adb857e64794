"""KV cache tensors of the paged backend, the KV cache groups, the pool sizing, and the
paged backend's worker side (``PagedKVWorker``: block tables and slot mappings).

Layers with the same attention type (full, or one sliding window) form KV cache groups;
each group has its own block ids per request (manager.py). Every group has
the same number of layers (the gcd of the per-type layer counts: Gemma 3 270M's 3 global and
15 local layers make 1 + 5 groups of 3), so that groups can share the block pool and the
tensors: tensor j holds the j-th layer of every group, and a block id, owned by one group at
a time, addresses one slice in each of that group's layers' tensors with none left idle.
A model with one attention type has one group and one tensor per layer, as before.
"""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.kv_backends.model_kv import attention_layers, kv_token_bytes
from pagedllm.kv_backends.paged.offload import OffloadOps, OffloadStore
from pagedllm.attention.layouts import BLOCK_TABLES
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.registry import bind_default_backend
from pagedllm.layers.attention import Attention
from pagedllm.platforms.registry import platform_of
from pagedllm.layers.kv_quant import cache_torch_dtype, row_bytes, row_width
from pagedllm.worker.kv_worker import KVCacheWorker, StepIndex

logger = logging.getLogger(__name__)


class KVCacheGroup(NamedTuple):
    sliding_window: int | None
    """The group's window, None for full attention."""
    layer_indices: list[int]
    """Positions of its layers in the model's list of Attention layers."""


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


def kv_bytes_per_block(
    model_config: ModelConfig, block_size: int, num_layers: int | None = None, kv_cache_dtype: str = "auto"
) -> int:
    """Bytes one block occupies over `num_layers` layers (default: all of them), K and V."""
    per_token = 2 * kv_token_bytes(model_config, kv_cache_dtype)
    return per_token * (num_layers or model_config.num_layers) * block_size


def num_blocks_for_budget(
    model_config: ModelConfig, block_size: int, memory_bytes: int, num_layers: int | None = None,
    kv_cache_dtype: str = "auto",
) -> int:
    """Blocks (including the null block 0) that fit in `memory_bytes`."""
    return memory_bytes // kv_bytes_per_block(model_config, block_size, num_layers, kv_cache_dtype)


def allocate_kv_caches(
    layers: list[Attention], num_blocks: int, block_size: int, dtype: str,
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """[2, num_blocks, block_size, num_kv_heads, head_dim] tensors, bound to the layers with
    each layer's group index; one tensor per layer slot (see the module docstring). ``dtype``
    is the storage name (config.resolve_kv_cache_dtype): a quantized one makes the last
    dimension head_dim + 4 (codes, then the row's scale; layers/kv_quant.py).

    On the host the pool is one anonymous mapping (host_zeros), whose zero pages the OS
    supplies on first touch: start-up does not touch gigabytes, and memory becomes resident
    as blocks are written. Zeros matter: the batched decode path reads (and masks) padding
    slots, and masked garbage could be NaN, which a zero attention weight does not cancel. On
    another device the pool is one zeroed allocation there.
    """
    assert layers, "model has no Attention layers"
    head_dim = layers[0].head_dim
    shape = (2, num_blocks, block_size, layers[0].num_kv_heads, row_width(dtype, head_dim))
    per_layer = int(np.prod(shape[:-1])) * row_bytes(dtype, head_dim)
    num_slots = num_layer_slots(layers)
    if platform_of(device).uses_host_memory:
        raw = host_zeros(per_layer * num_slots)
    else:
        raw = torch.zeros(per_layer * num_slots, dtype=torch.uint8, device=device)
    caches = [
        raw[i * per_layer : (i + 1) * per_layer].view(cache_torch_dtype(dtype)).view(shape)
        for i in range(num_slots)
    ]
    for group_id, group in enumerate(kv_cache_groups(layers)):
        for slot, layer_index in enumerate(group.layer_indices):
            layer = layers[layer_index]
            assert (layer.num_kv_heads, row_width(dtype, layer.head_dim)) == shape[3:], "layers differ in KV shape"
            layer.kv_cache = caches[slot]
            layer.kv_cache_group = group_id
    bind_default_backend(layers, BLOCK_TABLES, device)
    return caches


def host_zeros(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] of zeros in an anonymous private mapping with small pages: numpy's
    zeros (and glibc's calloc) of this size would ask for transparent huge pages, and each
    first write into a 2 MiB region then waits for the kernel to compact memory for one
    (13-38 ms a region measured on a machine with a full page cache; 60 such writes, one per
    layer's K and V, took 0.08-1.15 s of a first step against 1 ms with small pages)."""
    mm = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mm.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)  # keeps `mm` alive


def copy_blocks(kv_caches: list[torch.Tensor], blocks_to_copy: list[tuple[int, int]]) -> None:
    """Copy-on-write: copy each src block's K and V into dst, in every layer."""
    device = kv_caches[0].device
    src = torch.tensor([s for s, _ in blocks_to_copy], dtype=torch.int64).to(device, non_blocking=True)
    dst = torch.tensor([d for _, d in blocks_to_copy], dtype=torch.int64).to(device, non_blocking=True)
    for cache in kv_caches:  # [2, num_blocks, block_size, num_kv_heads, head_dim (+ 4)]
        raw = cache.view(torch.uint8)  # fp8 tensors lack some indexing kernels: move bytes
        raw[:, dst] = raw[:, src]


class PagedDraftKV:
    """A draft model's own KV cache in the paged layout, as many blocks of the same size as
    the target's pool, so the target's block ids (and its copy-on-write pairs) index it."""

    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, dtype: str) -> None:
        layers = attention_layers(model)
        if len(kv_cache_groups(layers)) != 1:
            raise ValueError("speculative_config model: the draft must be a full-attention model")
        self.kv_caches = allocate_kv_caches(layers, num_blocks, block_size, dtype)

    def copy_blocks(self, blocks_to_copy: list[tuple[int, int]]) -> None:
        copy_blocks(self.kv_caches, blocks_to_copy)


class PagedKVWorker(KVCacheWorker):
    """The paged backend's worker side: a block pool per layer slot, block tables per group."""

    layout = BLOCK_TABLES

    def __init__(
        self, layers: list[Attention], num_blocks: int, block_size: int, dtype: str,
        device: torch.device | str = "cpu", offload: OffloadStore | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.offload = offload  # the KV offload tiers (offload.py), shared with the manager
        self.block_size = block_size
        self.num_groups = len(kv_cache_groups(layers))
        self.kv_caches = allocate_kv_caches(layers, num_blocks, block_size, dtype, self.device)

    def prepare(self, so: SchedulerOutput) -> None:
        assert not so.kv_slots_to_release, "the paged pool reuses blocks in place"
        if so.kv_offload is not None:
            assert self.offload is not None
            apply_ops(self.kv_caches, so.kv_offload, self.offload)
        if so.blocks_to_copy:
            copy_blocks(self.kv_caches, so.blocks_to_copy)

    def persist_offload(self, ops: OffloadOps, timeout_s: float) -> None:
        assert self.offload is not None
        apply_ops(self.kv_caches, ops, self.offload)
        if not self.offload.flush(timeout_s):
            logger.warning("KV offload: not every block reached %s in %.0f s", self.offload.disk_dir, timeout_s)

    def read_blocks(self, block_ids: list[int]) -> list[np.ndarray]:
        return copy_out(self.kv_caches, block_ids)

    def make_draft_kv(self, model: nn.Module, dtype: str) -> PagedDraftKV:
        """The draft-model KV capability (spec_decode/proposer.py's ``DraftKVHost``): a cache
        of this pool's shape for ``model``'s layers, bound to them."""
        if self.num_groups != 1:
            raise ValueError("speculative_config model: the target must be a full-attention model")
        return PagedDraftKV(model, self.kv_caches[0].shape[1], self.block_size, dtype)

    def attention_metadata(
        self, block_ids: Sequence[list[list[int]]], step: StepIndex
    ) -> AttentionMetadata | list[AttentionMetadata]:
        bs = self.block_size
        # Host-side index arithmetic in numpy (zero-copy views of the CPU index tensors).
        positions = step.positions.numpy()
        req_of_token = step.req_of_token.numpy()
        max_blocks = (max(step.seq_lens_list) + bs - 1) // bs
        # Host-to-device copies are non-blocking (from pageable memory they return once the
        # source is staged): the step makes no host sync before sampling.
        seq_lens = step.seq_lens.to(self.device, non_blocking=True)
        starts = np.asarray(step.query_start_loc, dtype=np.int64)  # [R + 1]
        query_start = torch.from_numpy(starts).to(self.device, non_blocking=True)
        max_query_len = int((starts[1:] - starts[:-1]).max()) if len(starts) > 1 else 0
        # Per KV cache group: its own block table and slots (sliding-window groups hold
        # other blocks than full-attention ones); the rest of the metadata is shared.
        mds: list[AttentionMetadata] = []
        for group in range(self.num_groups):
            block_tables = np.zeros((len(block_ids), max_blocks), dtype=np.int64)  # [R, max_blocks]
            for i, ids_per_group in enumerate(block_ids):
                ids = ids_per_group[group][:max_blocks]
                block_tables[i, : len(ids)] = ids
            slot_mapping = block_tables[req_of_token, positions // bs] * bs + positions % bs  # [T]
            mds.append(
                AttentionMetadata(
                    slot_mapping=torch.from_numpy(slot_mapping).to(self.device, non_blocking=True),
                    block_tables=torch.from_numpy(block_tables).to(self.device, non_blocking=True),
                    seq_lens=seq_lens,
                    query_start_loc=step.query_start_loc,
                    seq_lens_list=step.seq_lens_list,
                    num_decodes=step.num_decodes,
                    block_size=bs,
                    query_start_loc_tensor=query_start,
                    max_query_len=max_query_len,
                )
            )
        return mds[0] if len(mds) == 1 else mds


def copy_out(kv_caches: list[torch.Tensor], block_ids: list[int]) -> list[np.ndarray]:
    """Images of the pool blocks ``block_ids``: per block ``[layers, 2, block_size, heads,
    row_bytes]`` uint8, flattened (worker side, torch)."""
    ids = torch.tensor(block_ids, dtype=torch.int64)
    stacked = torch.stack([c.view(torch.uint8)[:, ids] for c in kv_caches])  # [L, 2, n, bs, h, rb]
    images = stacked.movedim(2, 0).contiguous().numpy()  # [n, L, 2, bs, h, rb]
    return [images[i].reshape(-1).copy() for i in range(len(block_ids))]


def copy_in(kv_caches: list[torch.Tensor], block_ids: list[int], images: list[np.ndarray]) -> None:
    """Write block images (as ``copy_out`` makes them) into the pool blocks ``block_ids``."""
    ids = torch.tensor(block_ids, dtype=torch.int64)
    shape = kv_caches[0].view(torch.uint8)[:, 0].shape  # [2, bs, h, rb]
    src = torch.from_numpy(np.stack(images)).view(len(block_ids), len(kv_caches), *shape)
    for layer, cache in enumerate(kv_caches):
        cache.view(torch.uint8)[:, ids] = src[:, layer].movedim(0, 1)


def apply_ops(kv_caches: list[torch.Tensor], ops: OffloadOps, store: OffloadStore) -> None:
    """One step's copies, before the forward: evicted blocks out first (a load or this
    step's KV may overwrite them), then tier images in."""
    if ops.stores:
        images = copy_out(kv_caches, [block_id for block_id, _ in ops.stores])
        for (_, block_hash), image in zip(ops.stores, images):
            store.store(block_hash, image)
    if ops.loads:
        copy_in(kv_caches, [block_id for block_id, _ in ops.loads], [image for _, image in ops.loads])
