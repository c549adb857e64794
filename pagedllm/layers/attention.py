"""Paged attention over a flat batch of tokens from many requests.

The model sees one flat batch of `num_tokens` tokens (no padding). Per-step metadata (slot
mapping, block tables, sequence lengths) reaches every Attention layer through one scoped
forward context, set by the model runner around the forward pass.

Two KV cache layouts, per layer (K at index 0, V at index 1), built by the KV backends'
worker sides (worker/kv_worker.py):
- block tables: `[2, num_blocks, block_size, num_kv_heads, head_dim]`; a token's slot is
  `block_id * block_size + offset`;
- contiguous slots: `[2, num_slots, capacity, num_kv_heads, head_dim]`; the metadata carries
  each request's slot (`slots`), a token's row is `slot * capacity + position`, and a
  request's context is the contiguous slice `cache[:, slot, :seq_len]`.
With an 8-bit KV cache (``--kv-cache-dtype``) the last dimension is `head_dim + 4`: each
(token, head) row's codes, then its float32 scale (layers/kv_quant.py). The writes quantize;
the compiled decode kernels widen the codes themselves, the torch paths dequantize the rows
they read (`dequantize_rows`).

Implementations, chosen per layer by its `AttentionConfig` (config.py; the runner binds it):
- "torch": decodes in one call of the compiled kernel (or, where it cannot be built or is
  configured off, one padded SDPA call), prefill chunks one SDPA call each.
- "reference": a per-request, per-head loop in float64; obviously correct, slow, for tests.
- "triton": the Triton KV write and paged attention (layers/triton_attention.py), one launch
  each per layer for the whole batch; the block-table layout only.
A layer's scale, sliding window and logit soft-cap are its constructor's arguments (from the
model's configuration).
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.config import AttentionConfig
from pagedllm.kernels import paged_attention_ops
from pagedllm.layers.kv_quant import dequantize_rows, quant_format, quantize_rows

DEFAULT_CONFIG = AttentionConfig()


@dataclass
class AttentionMetadata:
    """Where each token of the flat batch reads and writes the KV cache.

    Requests are ordered decodes first (query length 1), then prefill chunks.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, physical slot of each token
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int64, padded with the null block 0
    seq_lens: torch.Tensor  # [num_reqs] int64, context length including this step's tokens
    query_start_loc: list[int]  # [num_reqs + 1], token offsets of each request's queries
    seq_lens_list: list[int]  # seq_lens as Python ints
    num_decodes: int  # the first num_decodes requests have exactly one query token
    block_size: int
    slots: torch.Tensor | None = None
    """Contiguous-slot layout: [num_reqs] int64, each request's slot (block_tables is then
    empty; the cache is [2, num_slots, capacity, Hkv, D], a request's KV cache[:, slot, :len])."""
    slots_list: list[int] | None = None
    query_start_loc_tensor: torch.Tensor | None = None
    """query_start_loc as a [num_reqs + 1] int64 tensor on the cache's device (device kernels)."""
    max_query_len: int | None = None
    """The longest query run of the step (host int; device kernels size their launch by it)."""

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_list)

    @functools.cached_property
    def longest_query_run(self) -> int:
        """The longest query run of the step (max_query_len where the builder set it)."""
        if self.max_query_len is not None:
            return self.max_query_len
        starts = self.query_start_loc
        return max((b - a for a, b in zip(starts, starts[1:])), default=0)

    @functools.cached_property
    def row_decodes(self) -> AttentionMetadata:
        """Every query row of the step as a one-token decode of its own context: the row at
        position p of request r reads r's K/V over [0, p] (r's block table or slot, the
        step's K/V already written), which is causal attention over a short run after a
        cached context (speculative verification) in the decode kernels' form. Built once
        per step (cached); the step itself when it is all decodes."""
        if self.num_decodes == self.num_reqs:
            return self
        starts = np.asarray(self.query_start_loc, dtype=np.int64)  # [R + 1]
        counts = np.diff(starts)  # [R]
        num_rows = int(starts[-1])
        req_of_row = np.repeat(np.arange(len(counts)), counts)  # [T]
        # Row t of request r sits at position seq_len[r] - (end[r] - t): its context length
        # is that position + 1.
        rows_after = starts[1:][req_of_row] - 1 - np.arange(num_rows)  # [T] later rows of its run
        row_lens = np.asarray(self.seq_lens_list, dtype=np.int64)[req_of_row] - rows_after  # [T]
        device = self.seq_lens.device
        index = torch.from_numpy(req_of_row).to(device)
        slots = None if self.slots is None else self.slots.index_select(0, index.to(self.slots.device))
        return AttentionMetadata(
            slot_mapping=self.slot_mapping,
            block_tables=self.block_tables if self.slots is not None else self.block_tables.index_select(0, index),
            seq_lens=torch.from_numpy(row_lens).to(device),
            query_start_loc=list(range(num_rows + 1)),
            seq_lens_list=row_lens.tolist(),
            num_decodes=num_rows,
            block_size=self.block_size,
            slots=slots,
            slots_list=None if self.slots_list is None else [self.slots_list[r] for r in req_of_row.tolist()],
            max_query_len=1,
        )


# One metadata for every layer, or one per KV cache group (indexed by the layer's group).
_forward_metadata: AttentionMetadata | list[AttentionMetadata] | None = None


@contextlib.contextmanager
def forward_context(metadata: AttentionMetadata | list[AttentionMetadata]) -> Iterator[None]:
    """Make `metadata` visible to every Attention layer for one forward pass.

    A list gives each KV cache group its own metadata (groups differ only in slot_mapping
    and block_tables: each group's layers keep their KV in that group's blocks).
    """
    global _forward_metadata
    prev, _forward_metadata = _forward_metadata, metadata
    try:
        yield
    finally:
        _forward_metadata = prev


def get_attention_metadata(kv_cache_group: int = 0) -> AttentionMetadata:
    md = _forward_metadata
    assert md is not None, "Attention called outside forward_context()"
    return md[kv_cache_group] if isinstance(md, list) else md


class Attention(nn.Module):
    """Multi-head attention with grouped-query heads, reading K/V from the paged cache.

    The runner binds `kv_cache` (one of the layouts above), `kv_cache_group` (whose block
    tables this layer reads) and `config` (the implementation) once after allocating the pool.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
        logit_soft_cap: float | None = None,
    ) -> None:
        """``logit_soft_cap`` c bounds each score s (after scaling) to c * tanh(s / c)."""
        super().__init__()
        if logit_soft_cap is not None and logit_soft_cap <= 0:
            raise ValueError(f"logit_soft_cap={logit_soft_cap} must be > 0 or None")
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_soft_cap = logit_soft_cap
        self.kv_cache: torch.Tensor | None = None
        self.kv_cache_group = 0
        self.config = DEFAULT_CONFIG
        self.bf16_min_rows: int | None = None
        """--prefill-activations bf16: first prompt chunks of at least this many tokens run
        torch's SDPA in bf16 (None: float32 always; layers/linear.set_prefill_activations)."""

    @property
    def backend(self) -> str:
        """The configured implementation's name ("torch" or "reference")."""
        return self.config.backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, num_heads * head_dim], k/v: [T, num_kv_heads * head_dim] -> [T, num_heads * head_dim]
        md = get_attention_metadata(self.kv_cache_group)
        assert self.kv_cache is not None, "KV cache not bound to this Attention layer"
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = _IMPLEMENTATIONS[self.config.backend](self, q, k, v, md)
        return out.view(num_tokens, self.num_heads * self.head_dim)


def _torch_impl(layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata):
    assert layer.kv_cache is not None
    write_kv(layer.kv_cache, k, v, md.slot_mapping)
    return torch_attention(
        q, k, v, layer.kv_cache, md, layer.scale, layer.sliding_window, layer.config, layer.logit_soft_cap,
        layer.bf16_min_rows,
    )


def _reference_impl(layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata):
    assert layer.kv_cache is not None
    write_kv(layer.kv_cache, k, v, md.slot_mapping)
    return reference_attention(q, layer.kv_cache, md, layer.scale, layer.sliding_window, layer.logit_soft_cap)


def _triton_impl(layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata):
    from pagedllm.layers.triton_attention import triton_attention

    assert layer.kv_cache is not None
    assert quant_format(layer.kv_cache) is None, "the Triton kernels read a float KV cache (EngineArgs refuses)"
    return triton_attention(q, k, v, layer.kv_cache, md, layer.scale, layer.sliding_window, layer.logit_soft_cap)


# AttentionConfig.backend -> (layer, q [T, H, D], k, v [T, Hkv, D], metadata) -> [T, H, D]; each
# writes this step's K/V into the layer's cache first.
_IMPLEMENTATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "torch": _torch_impl, "reference": _reference_impl, "triton": _triton_impl,
}


def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    # kv_cache: [2, num_blocks, block_size, Hkv, D (+ 4)]; k, v: [T, Hkv, D]; slot_mapping: [T]
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    fmt = quant_format(kv_cache)
    if fmt is None:
        flat[0].index_copy_(0, slot_mapping, k.to(flat.dtype))
        flat[1].index_copy_(0, slot_mapping, v.to(flat.dtype))
        return
    raw = flat.view(torch.uint8)  # fp8 dtypes have no index_copy_: the rows move as bytes
    raw[0].index_copy_(0, slot_mapping, quantize_rows(k, fmt).view(torch.uint8))
    raw[1].index_copy_(0, slot_mapping, quantize_rows(v, fmt).view(torch.uint8))


def _context(
    kv_cache: torch.Tensor, md: AttentionMetadata, i: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Request i's K and V over positions [0, seq_len): [seq_len, Hkv, D] each. Contiguous
    slots: plain views of its slot (no copy); block tables: gathered through its table."""
    if md.slots_list is not None:
        slot = md.slots_list[i]
        return kv_cache[0, slot, :seq_len], kv_cache[1, slot, :seq_len]
    num_blocks = (seq_len + md.block_size - 1) // md.block_size
    return _gather_context(kv_cache, md.block_tables[i, :num_blocks], seq_len)


def _gather_context(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    # block_table: [..., num_blocks] -> K, V: [..., num_blocks * block_size, Hkv, D]
    k = kv_cache[0][block_table]
    v = kv_cache[1][block_table]
    shape = (*block_table.shape[:-1], -1, kv_cache.shape[-2], kv_cache.shape[-1])
    k, v = k.reshape(shape), v.reshape(shape)
    if seq_len is not None:
        k, v = k[..., :seq_len, :, :], v[..., :seq_len, :, :]
    return k, v


def _causal_mask(query_len: int, seq_len: int, sliding_window: int | None) -> torch.Tensor:
    # Query i sits at position seq_len - query_len + i and sees keys j <= that position
    # (and, with a sliding window, j > position - window).
    q_pos = torch.arange(seq_len - query_len, seq_len).unsqueeze(1)
    k_pos = torch.arange(seq_len).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask  # [query_len, seq_len] bool, True = attend


def torch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    config: AttentionConfig = DEFAULT_CONFIG,
    logit_soft_cap: float | None = None,
    bf16_min_rows: int | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] (this step's, already written to kv_cache) -> [T, H, D].

    ``logit_soft_cap`` c bounds every score s (after scaling) to c * tanh(s / c) on every path:
    the decode kernels take it, the SDPA calls become explicit scores (`_attend`).
    ``bf16_min_rows``: a first prompt chunk of at least this many tokens (causal SDPA, no
    window or cap) runs SDPA on q, k, v rounded to bf16 (2-2.5x faster on a CPU with native
    bf16 at 256-1024 tokens), its output widened back; None: float32."""
    cap = logit_soft_cap
    nd = md.num_decodes
    if nd and nd == md.num_reqs:  # a pure decode step: one call, no copy into `out`
        return _decode_attention(q, kv_cache, md, scale, sliding_window, config, cap)
    if md.longest_query_run <= MAX_SHORT_RUN and _compiled_decode(q, md, config):
        # Decodes and short runs only (speculative verification): each row as a decode of
        # its own context, one kernel call (the fused decode's attention, models/fused_decode.py).
        return _decode_attention(q, kv_cache, md.row_decodes, scale, sliding_window, config, cap)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decode_attention(q[:nd], kv_cache, md, scale, sliding_window, config, cap)
    # Short query runs over a cached context (speculative verification): one padded call.
    short = [
        i for i in range(nd, md.num_reqs)
        if 1 < md.query_start_loc[i + 1] - md.query_start_loc[i] <= MAX_SHORT_RUN
        and md.query_start_loc[i + 1] - md.query_start_loc[i] < md.seq_lens_list[i]
    ]
    if len(short) > 1:
        _short_runs_attention(q, out, kv_cache, md, short, scale, sliding_window, cap)
    else:
        short = []
    for i in range(nd, md.num_reqs):
        if short and i in short:
            continue
        start, end = md.query_start_loc[i], md.query_start_loc[i + 1]
        seq_len, query_len = md.seq_lens_list[i], end - start
        if query_len == seq_len:
            # A first chunk: its whole context is this step's K/V, no need to read the cache.
            ki, vi = k[start:end], v[start:end]
        else:
            ki, vi = _context(kv_cache, md, i, seq_len)
            ki, vi = dequantize_rows(ki, q.dtype), dequantize_rows(vi, q.dtype)
        # 4-D [1, heads, tokens, D]: torch's CPU flash kernel takes 4-D inputs only (3-D ones
        # fall back to the math path, 2-5x slower at 256-1024 tokens).
        qi = q[start:end].transpose(0, 1)[None]  # [1, H, Q, D]
        ki, vi = ki.transpose(0, 1)[None], vi.transpose(0, 1)[None]  # [1, Hkv, S, D]
        if query_len == seq_len and sliding_window is None and cap is None:
            if bf16_min_rows is not None and query_len >= bf16_min_rows:
                qi, ki, vi = qi.bfloat16(), ki.bfloat16(), vi.bfloat16()
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
        else:
            o = _attend(qi, ki, vi, _causal_mask(query_len, seq_len, sliding_window), scale, cap)
        out[start:end] = o[0].transpose(0, 1)
    return out


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, cap: float | None
) -> torch.Tensor:
    """softmax(masked scores) @ v with grouped-query heads: q [..., H, Q, D], k/v
    [..., Hkv, S, D], mask [..., Q, S] bool (True = attend; None: every key) -> [..., H, Q, D].
    SDPA without a soft-cap; with one (SDPA has none) explicit scores cap * tanh(q.k * scale / cap)."""
    if cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    k = k.to(q.dtype).repeat_interleave(group, dim=-3)
    v = v.to(q.dtype).repeat_interleave(group, dim=-3)
    scores = (q @ k.transpose(-1, -2)) * scale  # [..., H, Q, S]
    scores = cap * torch.tanh(scores / cap)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    return scores.softmax(-1) @ v


MAX_SHORT_RUN = 16
"""The longest query run (drafts + 1) taken as short: a step of decodes and such runs goes
to the compiled decode kernel as row decodes (AttentionMetadata.row_decodes), here and in the
fused decode (models/fused_decode.py), so both paths agree; else such runs share one padded call."""


def _short_runs_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    rows: list[int],
    scale: float,
    sliding_window: int | None,
    cap: float | None = None,
) -> None:
    """Requests ``rows`` each have a short query run after a cached context: gather every
    context (block tables, or the rows' slots), pad the runs to the longest, one SDPA call;
    q: [T, H, D]."""
    starts = [md.query_start_loc[i] for i in rows]
    lens = [md.query_start_loc[i + 1] - md.query_start_loc[i] for i in rows]
    seq_lens = torch.tensor([md.seq_lens_list[i] for i in rows])  # [R]
    num_q = max(lens)
    if md.slots is not None:  # contiguous slots: the rows' slots up to the longest context
        slot_rows = md.slots[rows]
        max_len = int(seq_lens.max())
        k, v = kv_cache[0, slot_rows, :max_len], kv_cache[1, slot_rows, :max_len]  # [R, L, Hkv, D]
    else:
        max_blocks = (int(seq_lens.max()) + md.block_size - 1) // md.block_size
        k, v = _gather_context(kv_cache, md.block_tables[rows, :max_blocks])  # [R, L, Hkv, D]
    k, v = dequantize_rows(k, q.dtype), dequantize_rows(v, q.dtype)
    # Token index of each padded query slot in the flat batch (pads repeat the run's last).
    offsets = torch.arange(num_q).unsqueeze(0)  # [1, Qmax]
    lens_t = torch.tensor(lens).unsqueeze(1)  # [R, 1]
    index = torch.tensor(starts).unsqueeze(1) + torch.minimum(offsets, lens_t - 1)  # [R, Qmax]
    qr = q[index]  # [R, Qmax, H, D]
    q_pos = seq_lens.unsqueeze(1) - lens_t + torch.minimum(offsets, lens_t - 1)  # [R, Qmax]
    k_pos = torch.arange(k.shape[1]).view(1, 1, -1)  # [1, 1, L]
    mask = k_pos <= q_pos.unsqueeze(2)  # [R, Qmax, L]; also keeps keys < seq_len
    if sliding_window is not None:
        mask &= k_pos > q_pos.unsqueeze(2) - sliding_window
    o = _attend(
        qr.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask.unsqueeze(1), scale, cap
    ).transpose(1, 2)  # [R, Qmax, H, D]
    valid = offsets < lens_t  # [R, Qmax]
    out[index[valid]] = o[valid]


def _compiled_decode(q: torch.Tensor, md: AttentionMetadata, config: AttentionConfig) -> bool:
    """Whether `_decode_attention` runs the compiled kernel for this step."""
    if not config.compiled_kernels or q.device.type != "cpu":
        return False
    if md.slots is not None and config.contiguous_decode != "kernel":
        return False
    return paged_attention_ops() is not None


def _decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float, sliding_window: int | None,
    config: AttentionConfig = DEFAULT_CONFIG, cap: float | None = None,
) -> torch.Tensor:
    """One query token per request: q [nd, H, D] -> [nd, H, D]."""
    nd = q.shape[0]
    ops = paged_attention_ops() if config.compiled_kernels and q.device.type == "cpu" else None
    if md.slots is not None:
        use_kernel = ops is not None and config.contiguous_decode == "kernel"
        return _contiguous_decode_attention(q, kv_cache, md, scale, sliding_window, ops if use_kernel else None, cap)
    if ops is not None:
        # Reads K/V through the block table in place (no dense copy); soft-cap 0 is none.
        return ops.paged_decode_attention(
            q.contiguous(), kv_cache, md.block_tables[:nd], md.seq_lens[:nd], scale, sliding_window or 0, cap or 0.0
        )
    # Torch fallback: gather each request's blocks, pad to the longest, mask the rest.
    max_blocks = (max(md.seq_lens_list[:nd]) + md.block_size - 1) // md.block_size
    k, v = _gather_context(kv_cache, md.block_tables[:nd, :max_blocks])
    k, v = dequantize_rows(k, q.dtype), dequantize_rows(v, q.dtype)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [nd, L, Hkv, D] -> [nd, Hkv, L, D]
    key_pos = torch.arange(k.shape[2]).unsqueeze(0)
    seq_lens = md.seq_lens[:nd].unsqueeze(1)
    mask = key_pos < seq_lens  # [nd, L]
    if sliding_window is not None:
        mask &= key_pos >= seq_lens - sliding_window
    o = _attend(q.unsqueeze(2), k, v, mask[:, None, None, :], scale, cap)
    return o.squeeze(2)


def _contiguous_decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float,
    sliding_window: int | None, ops, cap: float | None = None,
) -> torch.Tensor:
    """Decodes of the contiguous-slot layout: each request's K/V is a slice of its slot;
    through the compiled kernel when ``ops`` is given."""
    nd = q.shape[0]
    assert md.slots is not None and md.slots_list is not None
    if ops is not None:
        return ops.contiguous_decode_attention(
            q.contiguous(), kv_cache, md.slots[:nd], md.seq_lens[:nd], scale, sliding_window or 0, cap or 0.0
        )
    # Torch formulation: one SDPA per request over views of its slot (no gather, no padding).
    out = torch.empty_like(q)
    for i in range(nd):
        seq_len = md.seq_lens_list[i]
        start = max(0, seq_len - sliding_window) if sliding_window is not None else 0
        slot = md.slots_list[i]
        k = dequantize_rows(kv_cache[0, slot, start:seq_len], q.dtype).transpose(0, 1)  # [Hkv, S, D]
        v = dequantize_rows(kv_cache[1, slot, start:seq_len], q.dtype).transpose(0, 1)
        out[i] = _attend(q[i].unsqueeze(1), k, v, None, scale, cap).squeeze(1)  # the slice is the window
    return out


def reference_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    logit_soft_cap: float | None = None,
) -> torch.Tensor:
    """Per request, per head, per query: softmax(q.k * scale) @ v in float64 (scores
    soft-capped to c * tanh(s / c) with ``logit_soft_cap`` c)."""
    num_heads, num_kv_heads = q.shape[1], kv_cache.shape[-2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for i in range(md.num_reqs):
        start, end = md.query_start_loc[i], md.query_start_loc[i + 1]
        seq_len = md.seq_lens_list[i]
        # Read the context token by token through the block table (or the request's slot).
        if md.slots_list is not None:
            base = md.slots_list[i] * kv_cache.shape[2]
            slots = [base + pos for pos in range(seq_len)]
        else:
            slots = [
                int(md.block_tables[i, pos // md.block_size]) * md.block_size + pos % md.block_size
                for pos in range(seq_len)
            ]
        flat = kv_cache.view(2, -1, num_kv_heads, kv_cache.shape[-1])
        k = dequantize_rows(flat[0][slots], torch.float64)  # [S, Hkv, D]
        v = dequantize_rows(flat[1][slots], torch.float64)
        mask = _causal_mask(end - start, seq_len, sliding_window)
        for h in range(num_heads):
            kh, vh = k[:, h // group], v[:, h // group]
            scores = (q[start:end, h].double() @ kh.T) * scale  # [Q, S]
            if logit_soft_cap is not None:
                scores = logit_soft_cap * torch.tanh(scores / logit_soft_cap)
            scores = scores.masked_fill(~mask, float("-inf"))
            out[start:end, h] = (scores.softmax(-1) @ vh).to(q.dtype)
    return out

