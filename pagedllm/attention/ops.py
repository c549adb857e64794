"""Torch building blocks the backends share: the KV write, masks, and the attention of one
padded batch with grouped-query heads (SDPA, or explicit scores where SDPA lacks a feature)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pagedllm.attention.params import AttentionParams
from pagedllm.layers.kv_quant import quant_format, quantize_rows


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    # kv_cache: [2, num_blocks, block_size, Hkv, D (+ 4)] (or [2, num_slots, capacity, ...]);
    # k, v: [T, Hkv, D]; slot_mapping: [T], the token's row in the flattened cache
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    fmt = quant_format(kv_cache)
    if fmt is None:
        flat[0].index_copy_(0, slot_mapping, k.to(flat.dtype))
        flat[1].index_copy_(0, slot_mapping, v.to(flat.dtype))
        return
    raw = flat.view(torch.uint8)  # fp8 dtypes have no index_copy_: the rows move as bytes
    raw[0].index_copy_(0, slot_mapping, quantize_rows(k, fmt).view(torch.uint8))
    raw[1].index_copy_(0, slot_mapping, quantize_rows(v, fmt).view(torch.uint8))


def causal_mask(query_len: int, seq_len: int, sliding_window: int | None) -> torch.Tensor:
    # Query i sits at position seq_len - query_len + i and sees keys j <= that position
    # (and, with a sliding window, j > position - window).
    q_pos = torch.arange(seq_len - query_len, seq_len).unsqueeze(1)
    k_pos = torch.arange(seq_len).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask  # [query_len, seq_len] bool, True = attend


def gather_context(
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


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, params: AttentionParams,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(masked scores) @ v with grouped-query heads: q [..., H, Q, D], k/v
    [..., Hkv, S, D], mask [..., Q, S] bool (True = attend; None: every key) -> [..., H, Q, D].
    SDPA without a soft-cap or sinks; with either (SDPA has neither) explicit scores:
    cap * tanh(q.k * scale / cap), and each head's sink logit ([H]) as one more softmax
    column with no value row. ``params``: the layer's scale and soft-cap (its other features
    are in ``mask`` and ``sinks``)."""
    scale, cap = params.scale, params.logit_soft_cap
    if cap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    k = k.to(q.dtype).repeat_interleave(group, dim=-3)
    v = v.to(q.dtype).repeat_interleave(group, dim=-3)
    scores = (q @ k.transpose(-1, -2)) * scale  # [..., H, Q, S]
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    if sinks is None:
        return scores.softmax(-1) @ v
    sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(*scores.shape[:-1], 1)  # [..., H, Q, 1]
    weights = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return weights @ v
