"""The interface every attention implementation has (vLLM V1's backend + metadata builder
over one common metadata, mini-sglang's `prepare_metadata` / `forward` on one object).

A backend is built once at start-up by the registry (registry.py) from the configuration,
the device, the KV worker's layout and the layers' features, and bound to every Attention
layer; it then runs every path of a step (decode rows, first prompt chunks, continuation
chunks, k + 1 verification rows) without asking which layout or implementation it is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Protocol

import torch

from pagedllm.attention.layouts import KVLayout
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.ops import write_kv
from pagedllm.attention.params import AttentionParams


class AttentionLayerState(Protocol):
    """What a backend reads from the layer it runs for (layers/attention.Attention)."""

    kv_cache: torch.Tensor | None
    params: AttentionParams
    sinks: torch.Tensor | None  # [H] learned logits where params.sinks
    bf16_min_rows: int | None


class AttentionBackend(ABC):
    """One attention implementation over one KV layout."""

    name: ClassVar[str]
    """The implementation's name in messages (the registry maps configuration names)."""
    runs: ClassVar[frozenset[str]] = frozenset()
    """The AttentionParams features (AttentionParams.features) this backend computes."""
    runs_fused_decode: ClassVar[bool] = False
    """Whether decode steps may skip the layers for models/fused_decode.py's compiled call
    (whose attention is the compiled decode kernel's: torch-family backends only)."""
    graph_capturable: ClassVar[bool] = False
    """Whether a decode step's forward reads only device tensors and per-size host values,
    so worker/cuda_graphs.py may capture and replay it."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout

    def check(self, params: AttentionParams) -> None:
        """Refuse, at start-up, a layer whose features this backend does not compute."""
        for feature in params.features():
            if feature not in self.runs:
                raise ValueError(
                    f"attention backend {self.name!r} ({self.layout.name}) does not run "
                    f"{feature}={getattr(params, feature)!r}; "
                    f"it runs {', '.join(sorted(self.runs)) or 'no optional feature'}"
                )

    def prepare_metadata(self, md: AttentionMetadata) -> AttentionMetadata:
        """The step's common metadata (from the KV worker) completed with what this
        backend's kernels read; called once per step by the runner, before the forward."""
        return md

    def forward(
        self, layer: AttentionLayerState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """Write this step's K/V into ``layer.kv_cache``, then attend: q [T, H, D], k/v
        [T, Hkv, D] -> [T, H, D]."""
        assert layer.kv_cache is not None, "KV cache not bound to this Attention layer"
        self.write(layer.kv_cache, k, v, md)
        return self.attend(layer, q, k, v, md)

    def write(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> None:
        """This step's K/V [T, Hkv, D] into the cache rows md.slot_mapping names."""
        write_kv(kv_cache, k, v, md.slot_mapping)

    @abstractmethod
    def attend(
        self, layer: AttentionLayerState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """Attention of the step's queries over the cache (this step's K/V written already;
        k/v [T, Hkv, D] are the same values, for paths that read them directly): q [T, H, D]
        -> [T, H, D]."""
