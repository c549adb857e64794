"""Run one attention backend over a hand-built cache and metadata (no model, no Attention
module): the float64 reference, or the backend the registry picks for a configuration."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.attention.layouts import BLOCK_TABLES, KVLayout
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.params import AttentionParams
from pagedllm.attention.reference import ReferenceBackend
from pagedllm.attention.registry import select_backend
from pagedllm.config import AttentionConfig


@dataclass
class LayerState:
    """What a backend reads from a layer (attention/backend.AttentionLayerState)."""

    kv_cache: torch.Tensor
    params: AttentionParams
    sinks: torch.Tensor | None = None
    bf16_min_rows: int | None = None


def reference_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float,
    sliding_window: int | None = None, logit_soft_cap: float | None = None, layout: KVLayout = BLOCK_TABLES,
) -> torch.Tensor:
    """The reference over the cache as it is (the step's K/V written by the caller): q [T, H, D]."""
    state = LayerState(kv_cache, AttentionParams(scale, sliding_window, logit_soft_cap))
    return ReferenceBackend(layout).attend(state, q, None, None, md)  # type: ignore[arg-type]


def backend_attention(
    config: AttentionConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
    md: AttentionMetadata, scale: float, sliding_window: int | None = None, logit_soft_cap: float | None = None,
    layout: KVLayout = BLOCK_TABLES,
) -> torch.Tensor:
    """The configured backend (chosen by the registry for the CPU) writing k, v and attending."""
    params = AttentionParams(scale, sliding_window, logit_soft_cap)
    backend = select_backend(config, layout, q.device, [params])
    return backend.forward(LayerState(kv_cache, params), q, k, v, md)
