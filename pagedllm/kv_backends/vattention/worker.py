"""The vattention backend's worker side: reserved address space, pages on first touch.

One anonymous ``mmap`` with ``MAP_NORESERVE`` reserves, for every Attention layer, a K and a
V region of ``num_slots`` slots of ``slot_capacity`` tokens. Nothing is resident until a
token is written; each layer's cache is a zero-copy torch view ``[2, num_slots,
slot_capacity, num_kv_heads, head_dim]`` of it, so a request's K (or V) in a layer is the
contiguous slice ``cache[0, slot, :seq_len]`` (attention/layouts.py's contiguous-slot
layout: the metadata carries each request's slot). The budget is kept by the scheduler's
``VAttentionKVManager`` (manager.py); before a step, the pages of the slots it names are
released with ``madvise(MADV_DONTNEED)`` (they read back as zeros, no longer resident).

Every (region, slot) span is a multiple of 2 MiB and starts 2 MiB-aligned, so with
transparent huge pages (``MADV_HUGEPAGE``) releasing a slot never splits a huge page.
The mapping is never closed while the views live (a closed mmap under a live tensor view
segfaults on access); it lives as long as the runner.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence

import torch

from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.attention.layouts import CONTIGUOUS_SLOTS
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.registry import bind_default_backend
from pagedllm.layers.attention import Attention
from pagedllm.layers.kv_quant import cache_torch_dtype, row_bytes, row_width
from pagedllm.worker.kv_worker import KVCacheWorker, StepIndex

MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Python < 3.13 lacks the constant
HUGE = 2 << 20
SMALL_PAGE = mmap.PAGESIZE


_NO_BLOCK_TABLE = torch.zeros((0, 0), dtype=torch.int64)


class VAttentionKVCache(KVCacheWorker):
    """Per layer, a [2, num_slots, slot_capacity, Hkv, D] view of one reserved mapping."""

    num_groups = 1
    device = torch.device("cpu")  # an mmap is host memory
    layout = CONTIGUOUS_SLOTS

    def __init__(
        self, layers: list[Attention], num_slots: int, slot_capacity: int, dtype: str, hugepages: bool = False
    ) -> None:
        assert layers, "model has no Attention layers"
        self.num_layers = len(layers)
        self.num_slots = num_slots
        self.slot_capacity = slot_capacity
        num_kv_heads, head_dim = layers[0].num_kv_heads, layers[0].head_dim
        torch_dtype = cache_torch_dtype(dtype)  # dtype: a storage name (layers/kv_quant.py)
        self.token_bytes = num_kv_heads * row_bytes(dtype, head_dim)
        self.span_bytes = slot_capacity * self.token_bytes  # one (region, slot)
        assert self.span_bytes % HUGE == 0, "slot_capacity must make 2 MiB spans"
        self.layer_bytes = 2 * num_slots * self.span_bytes
        total = self.num_layers * self.layer_bytes
        self.mm = mmap.mmap(
            -1, total + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )
        self.hugepages = hugepages
        self.mm.madvise(mmap.MADV_HUGEPAGE if hugepages else mmap.MADV_NOHUGEPAGE)
        if hasattr(mmap, "MADV_DONTFORK"):
            self.mm.madvise(mmap.MADV_DONTFORK)  # a forked child must not copy-on-write it
        raw = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.base = raw.data_ptr()
        self.offset = (-self.base) % HUGE  # first 2 MiB boundary inside the mapping
        shape = (2, num_slots, slot_capacity, num_kv_heads, row_width(dtype, head_dim))
        self.kv_caches = [
            raw[self.offset + i * self.layer_bytes : self.offset + (i + 1) * self.layer_bytes]
            .view(torch_dtype)
            .view(shape)
            for i in range(self.num_layers)
        ]
        for layer, cache in zip(layers, self.kv_caches):
            assert (layer.num_kv_heads, row_width(dtype, layer.head_dim)) == shape[3:], "layers differ in KV shape"
            layer.kv_cache = cache
            layer.kv_cache_group = 0
        bind_default_backend(layers, CONTIGUOUS_SLOTS, self.device)

    @property
    def mapping_range(self) -> tuple[int, int]:
        """[start, end) addresses of the mapping (to find it in /proc/self/smaps)."""
        return self.base, self.base + len(self.mm)

    def prepare(self, so: SchedulerOutput) -> None:
        assert not so.blocks_to_copy, "slots are never shared, so never copied"
        if so.kv_slots_to_release:
            self.release(so.kv_slots_to_release)

    def attention_metadata(self, block_ids: Sequence[list[list[int]]], step: StepIndex) -> AttentionMetadata:
        # A request's one id is its slot; the token at position p of slot s is row
        # s * capacity + p of the flattened cache. No block table.
        slots_list = [ids[0][0] for ids in block_ids]
        slots = torch.tensor(slots_list, dtype=torch.int64)  # [R]
        slot_mapping = slots[step.req_of_token] * self.slot_capacity + step.positions  # [T]
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=_NO_BLOCK_TABLE,
            seq_lens=step.seq_lens,
            query_start_loc=step.query_start_loc,
            seq_lens_list=step.seq_lens_list,
            num_decodes=step.num_decodes,
            block_size=1,
            slots=slots,
            slots_list=slots_list,
        )

    def release(self, slots: list[int]) -> None:
        """Give the slots' pages back to the OS (they read back as zeros)."""
        for slot in slots:
            for layer in range(self.num_layers):
                for kv in (0, 1):
                    start = self.offset + layer * self.layer_bytes + (kv * self.num_slots + slot) * self.span_bytes
                    self.mm.madvise(mmap.MADV_DONTNEED, start, self.span_bytes)


def mapping_rss_bytes(start: int, end: int) -> int:
    """Rss of the mappings inside [start, end) per /proc/self/smaps (Linux), in bytes."""
    rss = 0
    inside = False
    with open(f"/proc/{os.getpid()}/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and hi > start
            elif inside and line.startswith("Rss:"):
                rss += int(line.split()[1]) * 1024
    return rss
