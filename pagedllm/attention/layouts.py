"""The two KV cache layouts a backend reads, as objects (the KV worker declares its layout;
the registry hands it to the backend it picks), so no backend asks the metadata which one
it has.

- block tables: `[2, num_blocks, block_size, Hkv, D]`; a token's slot is
  `block_id * block_size + offset` (the paged backend);
- contiguous slots: `[2, num_slots, capacity, Hkv, D]`; the metadata carries each request's
  slot (`slots`), a token's row is `slot * capacity + position`, and a request's context is
  the contiguous slice `cache[:, slot, :seq_len]` (vattention).
With an 8-bit KV cache the last dimension is `head_dim + 4` (layers/kv_quant.py); the torch
reads here dequantize (`dequantize_rows`), the compiled kernels widen the codes themselves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from pagedllm.attention.kernel_args import kernel_args
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.ops import attend, gather_context
from pagedllm.attention.params import AttentionParams
from pagedllm.config import AttentionConfig
from pagedllm.layers.kv_quant import dequantize_rows

_EMPTY = torch.empty(0)


class KVLayout(ABC):
    """How a request's K/V is found in a layer's cache from the step's metadata."""

    name: str
    has_block_tables: bool
    """Whether the metadata's block_tables address the cache (kernels that read only them)."""

    @abstractmethod
    def context(
        self, kv_cache: torch.Tensor, md: AttentionMetadata, i: int, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Request i's K and V over positions [0, seq_len): [seq_len, Hkv, D] each (as stored)."""

    @abstractmethod
    def padded_contexts(
        self, kv_cache: torch.Tensor, md: AttentionMetadata, rows: list[int], max_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Requests ``rows``' K and V padded to at least ``max_len`` positions: [R, L, Hkv, D]
        (as stored; positions past a request's length hold whatever the cache holds)."""

    @abstractmethod
    def token_rows(self, kv_cache: torch.Tensor, md: AttentionMetadata, i: int, seq_len: int) -> list[int]:
        """Request i's positions [0, seq_len) as rows of the flattened [2, -1, Hkv, D] cache."""

    @abstractmethod
    def torch_decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, params: AttentionParams,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """One query token per request in torch ops: q [nd, H, D] -> [nd, H, D]."""

    @abstractmethod
    def compiled_decode_enabled(self, config: AttentionConfig) -> bool:
        """Whether the configuration lets this layout's decodes run the compiled kernel."""

    @abstractmethod
    def kernel_decode(
        self, ops: Any, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, params: AttentionParams,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One query token per request through the compiled kernel: q [nd, H, D] -> [nd, H, D]
        (``sinks``: the layer's [H] logits where params.sinks)."""

    @abstractmethod
    def kernel_slots(self, md: AttentionMetadata, rows: int) -> torch.Tensor:
        """The compiled forwards' slots argument for the first ``rows`` requests (empty: read
        the block tables)."""


class BlockTableLayout(KVLayout):
    name = "block tables"
    has_block_tables = True

    def context(self, kv_cache, md, i, seq_len):
        num_blocks = (seq_len + md.block_size - 1) // md.block_size
        return gather_context(kv_cache, md.block_tables[i, :num_blocks], seq_len)

    def padded_contexts(self, kv_cache, md, rows, max_len):
        max_blocks = (max_len + md.block_size - 1) // md.block_size
        return gather_context(kv_cache, md.block_tables[rows, :max_blocks])

    def token_rows(self, kv_cache, md, i, seq_len):
        bs = md.block_size
        return [int(md.block_tables[i, pos // bs]) * bs + pos % bs for pos in range(seq_len)]

    def torch_decode(self, q, kv_cache, md, params, sinks):
        # Gather each request's blocks, pad to the longest, mask the rest: one call.
        nd = q.shape[0]
        window = params.sliding_window
        k, v = self.padded_contexts(kv_cache, md, list(range(nd)), max(md.seq_lens_list[:nd]))
        k, v = dequantize_rows(k, q.dtype), dequantize_rows(v, q.dtype)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [nd, L, Hkv, D] -> [nd, Hkv, L, D]
        key_pos = torch.arange(k.shape[2]).unsqueeze(0)
        seq_lens = md.seq_lens[:nd].unsqueeze(1)
        mask = key_pos < seq_lens  # [nd, L]
        if window is not None:
            mask &= key_pos >= seq_lens - window
        o = attend(q.unsqueeze(2), k, v, mask[:, None, None, :], params, sinks)
        return o.squeeze(2)

    def compiled_decode_enabled(self, config):
        return True

    def kernel_decode(self, ops, q, kv_cache, md, params, sinks=None):
        # Reads K/V through the block table in place (no dense copy).
        nd = q.shape[0]
        return ops.paged_decode_attention(
            q.contiguous(), kv_cache, md.block_tables[:nd], md.seq_lens[:nd], *kernel_args(params), sinks
        )

    def kernel_slots(self, md, rows):
        return _EMPTY


class ContiguousSlotsLayout(KVLayout):
    name = "contiguous slots"
    has_block_tables = False

    def context(self, kv_cache, md, i, seq_len):
        assert md.slots_list is not None, "contiguous-slot metadata carries each request's slot"
        slot = md.slots_list[i]
        return kv_cache[0, slot, :seq_len], kv_cache[1, slot, :seq_len]  # views, no copy

    def padded_contexts(self, kv_cache, md, rows, max_len):
        assert md.slots is not None
        slot_rows = md.slots[rows]
        return kv_cache[0, slot_rows, :max_len], kv_cache[1, slot_rows, :max_len]

    def token_rows(self, kv_cache, md, i, seq_len):
        assert md.slots_list is not None
        base = md.slots_list[i] * kv_cache.shape[2]
        return [base + pos for pos in range(seq_len)]

    def torch_decode(self, q, kv_cache, md, params, sinks):
        # One SDPA per request over views of its slot (no gather, no padding).
        assert md.slots_list is not None
        window = params.sliding_window
        out = torch.empty_like(q)
        for i in range(q.shape[0]):
            seq_len = md.seq_lens_list[i]
            start = max(0, seq_len - window) if window is not None else 0
            slot = md.slots_list[i]
            k = dequantize_rows(kv_cache[0, slot, start:seq_len], q.dtype).transpose(0, 1)  # [Hkv, S, D]
            v = dequantize_rows(kv_cache[1, slot, start:seq_len], q.dtype).transpose(0, 1)
            # The slice is the window: no mask.
            out[i] = attend(q[i].unsqueeze(1), k, v, None, params, sinks).squeeze(1)
        return out

    def compiled_decode_enabled(self, config):
        return config.contiguous_decode == "kernel"

    def kernel_decode(self, ops, q, kv_cache, md, params, sinks=None):
        nd = q.shape[0]
        return ops.contiguous_decode_attention(
            q.contiguous(), kv_cache, self.kernel_slots(md, nd), md.seq_lens[:nd], *kernel_args(params), sinks
        )

    def kernel_slots(self, md, rows):
        assert md.slots is not None
        return md.slots[:rows]


BLOCK_TABLES = BlockTableLayout()
CONTIGUOUS_SLOTS = ContiguousSlotsLayout()
