"""The torch backends: prefill chunks one SDPA call each, decodes in one call (the compiled
C++ kernel in `CompiledBackend`, padded torch ops in `TorchBackend`), over either KV layout.

A step's paths, all here: a pure decode step is one decode call; with the compiled kernel a
step of decodes and short runs (speculative verification, a prompt's short chunk) is one
call over its rows as decodes (`AttentionMetadata.row_decodes`, as the fused decode does);
otherwise decodes, then the short runs padded into one call, then each longer chunk.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionBackend, AttentionLayerState
from pagedllm.attention.layouts import KVLayout
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.ops import attend, causal_mask
from pagedllm.layers.kv_quant import dequantize_rows

MAX_SHORT_RUN = 16
"""The longest query run (drafts + 1) taken as short: a step of decodes and such runs goes
to the compiled decode kernel as row decodes (AttentionMetadata.row_decodes), here and in the
fused decode (models/fused_decode.py), so both paths agree; else such runs share one padded call."""


class TorchBackend(AttentionBackend):
    """Torch ops only: SDPA per prefill chunk, padded torch decodes (any device)."""

    name = "torch"
    runs = frozenset({"sliding_window", "logit_soft_cap", "sinks", "causal"})
    runs_fused_decode = True
    rows_as_decodes = False
    """Whether a step of decodes and short runs goes to `decode` as row decodes."""

    def attend(self, layer, q, k, v, md):
        if not layer.params.causal:
            _check_prompt_only(md, self.name)
        if md.num_decodes and md.num_decodes == md.num_reqs:  # a pure decode step: one call
            return self.decode(layer, q, md)
        if self.rows_as_decodes and md.longest_query_run <= MAX_SHORT_RUN:
            return self.decode(layer, q, md.row_decodes)
        return self._mixed(layer, q, k, v, md)

    def decode(self, layer: AttentionLayerState, q: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """One query token per request: q [nd, H, D] -> [nd, H, D]."""
        assert layer.kv_cache is not None
        return self.layout.torch_decode(q, layer.kv_cache, md, layer.params, layer.sinks)

    def _mixed(
        self, layer: AttentionLayerState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        nd = md.num_decodes
        if nd:
            out[:nd] = self.decode(layer, q[:nd], md)
        # Short query runs over a cached context (speculative verification): one padded call.
        short = [
            i for i in range(nd, md.num_reqs)
            if 1 < md.query_start_loc[i + 1] - md.query_start_loc[i] <= MAX_SHORT_RUN
            and md.query_start_loc[i + 1] - md.query_start_loc[i] < md.seq_lens_list[i]
        ]
        if len(short) > 1:
            self._short_runs(layer, q, out, md, short)
        else:
            short = []
        for i in range(nd, md.num_reqs):
            if short and i in short:
                continue
            start, end = md.query_start_loc[i], md.query_start_loc[i + 1]
            out[start:end] = self._chunk(layer, q, k, v, md, i)
        return out

    def _chunk(
        self, layer: AttentionLayerState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        md: AttentionMetadata, i: int,
    ) -> torch.Tensor:
        """Request i's prompt chunk: [query_len, H, D]."""
        assert layer.kv_cache is not None
        p = layer.params
        start, end = md.query_start_loc[i], md.query_start_loc[i + 1]
        seq_len, query_len = md.seq_lens_list[i], end - start
        if query_len == seq_len:
            # A first chunk: its whole context is this step's K/V, no need to read the cache.
            ki, vi = k[start:end], v[start:end]
        else:
            ki, vi = self.layout.context(layer.kv_cache, md, i, seq_len)
            ki, vi = dequantize_rows(ki, q.dtype), dequantize_rows(vi, q.dtype)
        # 4-D [1, heads, tokens, D]: torch's CPU flash kernel takes 4-D inputs only (3-D ones
        # fall back to the math path, 2-5x slower at 256-1024 tokens).
        qi = q[start:end].transpose(0, 1)[None]  # [1, H, Q, D]
        ki, vi = ki.transpose(0, 1)[None], vi.transpose(0, 1)[None]  # [1, Hkv, S, D]
        if query_len == seq_len and p.sliding_window is None and p.logit_soft_cap is None and not p.sinks:
            # bf16_min_rows: a first chunk this long runs SDPA on q, k, v rounded to bf16
            # (2-2.5x faster on a CPU with native bf16 at 256-1024 tokens), widened back.
            if layer.bf16_min_rows is not None and query_len >= layer.bf16_min_rows:
                qi, ki, vi = qi.bfloat16(), ki.bfloat16(), vi.bfloat16()
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=p.causal, scale=p.scale, enable_gqa=True)
        else:
            mask = causal_mask(query_len, seq_len, p.sliding_window) if p.causal else None
            o = attend(qi, ki, vi, mask, p, layer.sinks)
        return o[0].transpose(0, 1)

    def _short_runs(
        self, layer: AttentionLayerState, q: torch.Tensor, out: torch.Tensor, md: AttentionMetadata, rows: list[int]
    ) -> None:
        """Requests ``rows`` each have a short query run after a cached context: gather every
        context, pad the runs to the longest, one SDPA call; q: [T, H, D]."""
        assert layer.kv_cache is not None
        p = layer.params
        starts = [md.query_start_loc[i] for i in rows]
        lens = [md.query_start_loc[i + 1] - md.query_start_loc[i] for i in rows]
        seq_lens = torch.tensor([md.seq_lens_list[i] for i in rows])  # [R]
        num_q = max(lens)
        k, v = self.layout.padded_contexts(layer.kv_cache, md, rows, int(seq_lens.max()))  # [R, L, Hkv, D]
        k, v = dequantize_rows(k, q.dtype), dequantize_rows(v, q.dtype)
        # Token index of each padded query slot in the flat batch (pads repeat the run's last).
        offsets = torch.arange(num_q).unsqueeze(0)  # [1, Qmax]
        lens_t = torch.tensor(lens).unsqueeze(1)  # [R, 1]
        index = torch.tensor(starts).unsqueeze(1) + torch.minimum(offsets, lens_t - 1)  # [R, Qmax]
        qr = q[index]  # [R, Qmax, H, D]
        q_pos = seq_lens.unsqueeze(1) - lens_t + torch.minimum(offsets, lens_t - 1)  # [R, Qmax]
        k_pos = torch.arange(k.shape[1]).view(1, 1, -1)  # [1, 1, L]
        mask = k_pos <= q_pos.unsqueeze(2)  # [R, Qmax, L]; also keeps keys < seq_len
        if p.sliding_window is not None:
            mask &= k_pos > q_pos.unsqueeze(2) - p.sliding_window
        o = attend(
            qr.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask.unsqueeze(1), p, layer.sinks,
        ).transpose(1, 2)  # [R, Qmax, H, D]
        valid = offsets < lens_t  # [R, Qmax]
        out[index[valid]] = o[valid]


class CompiledBackend(TorchBackend):
    """`TorchBackend` with decodes (and a step's rows as decodes) through the compiled C++
    kernel (kernels/csrc/paged_attention.cpp), which reads K/V in place: the CPU default."""

    name = "torch (compiled kernels)"
    runs = frozenset({"sliding_window", "logit_soft_cap", "sinks"})
    rows_as_decodes = True

    def __init__(self, layout: KVLayout, ops: Any) -> None:
        super().__init__(layout)
        self.ops = ops

    def decode(self, layer: AttentionLayerState, q: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        assert layer.kv_cache is not None
        return self.layout.kernel_decode(self.ops, q, layer.kv_cache, md, layer.params, layer.sinks)


def _check_prompt_only(md: AttentionMetadata, backend: str) -> None:
    """Bidirectional attention is defined over a whole prompt: every request's one chunk."""
    starts = md.query_start_loc
    for i, seq_len in enumerate(md.seq_lens_list):
        if starts[i + 1] - starts[i] != seq_len:
            raise ValueError(
                f"attention backend {backend!r}: causal=False runs prompt-only steps (each request's "
                f"whole prompt in one chunk); request {i} has {starts[i + 1] - starts[i]} of {seq_len} tokens"
            )
