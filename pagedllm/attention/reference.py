"""The reference backend: per request, per head, per query, in float64; obviously correct,
slow, for tests. It runs every feature of AttentionParams, and is where a new feature is
first written down."""

from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.ops import causal_mask
from pagedllm.attention.torch_backend import _check_prompt_only
from pagedllm.layers.kv_quant import dequantize_rows


class ReferenceBackend(AttentionBackend):
    name = "reference"
    runs = frozenset({"sliding_window", "logit_soft_cap", "sinks", "causal", "head_bias"})

    def attend(self, layer, q, k, v, md):
        # softmax(q.k * scale) @ v per (request, head), scores soft-capped to c * tanh(s / c),
        # each head's sink logit one more softmax column with no value row; K/V read back
        # from the cache (k, v unused).
        kv_cache = layer.kv_cache
        assert kv_cache is not None, "KV cache not bound to this Attention layer"
        p = layer.params
        if not p.causal:
            _check_prompt_only(md, self.name)
        num_heads, num_kv_heads = q.shape[1], kv_cache.shape[-2]
        group = num_heads // num_kv_heads
        flat = kv_cache.view(2, -1, num_kv_heads, kv_cache.shape[-1])
        out = torch.empty_like(q)
        for i in range(md.num_reqs):
            start, end = md.query_start_loc[i], md.query_start_loc[i + 1]
            seq_len = md.seq_lens_list[i]
            rows = self.layout.token_rows(kv_cache, md, i, seq_len)  # token by token
            k_ctx = dequantize_rows(flat[0][rows], torch.float64)  # [S, Hkv, D]
            v_ctx = dequantize_rows(flat[1][rows], torch.float64)
            mask = causal_mask(end - start, seq_len, p.sliding_window) if p.causal else None
            for h in range(num_heads):
                kh, vh = k_ctx[:, h // group], v_ctx[:, h // group]
                scores = (q[start:end, h].double() @ kh.T) * p.scale  # [Q, S]
                if p.logit_soft_cap is not None:
                    scores = p.logit_soft_cap * torch.tanh(scores / p.logit_soft_cap)
                if p.head_bias is not None:
                    scores = scores + p.head_bias[h]
                if mask is not None:
                    scores = scores.masked_fill(~mask, float("-inf"))
                if layer.sinks is not None:
                    sink = layer.sinks[h].double().expand(scores.shape[0], 1)  # [Q, 1]
                    weights = torch.cat([scores, sink], dim=1).softmax(-1)[:, :-1]
                else:
                    weights = scores.softmax(-1)
                out[start:end, h] = (weights @ vh).to(q.dtype)
        return out
