"""The one place an attention backend is chosen by name: once, at start-up, from the
configuration (`AttentionConfig.backend`), the device, the KV worker's layout and the
features the layers declare; then checked against every layer and bound to it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.layouts import KVLayout
from pagedllm.attention.params import AttentionParams
from pagedllm.attention.reference import ReferenceBackend
from pagedllm.attention.torch_backend import CompiledBackend, TorchBackend
from pagedllm.config import AttentionConfig
from pagedllm.kernels import paged_attention_ops
from pagedllm.platforms.registry import platform_of

if TYPE_CHECKING:
    from pagedllm.layers.attention import Attention


def _torch(
    config: AttentionConfig, layout: KVLayout, device: torch.device, params: Sequence[AttentionParams]
) -> AttentionBackend:
    # The compiled decode where the platform runs compiled kernels, it builds, the
    # configuration allows it, and it runs every layer's features; else torch ops only (the
    # same outputs, slower decodes).
    runs_compiled = platform_of(device).runs_compiled_kernels
    if config.compiled_kernels and runs_compiled and layout.compiled_decode_enabled(config):
        features = {f for p in params for f in p.features()}
        ops = paged_attention_ops() if features <= CompiledBackend.runs else None
        if ops is not None:
            return CompiledBackend(layout, ops)
    return TorchBackend(layout)


def _reference(config, layout, device, params) -> AttentionBackend:
    return ReferenceBackend(layout)


def _triton(config, layout, device, params) -> AttentionBackend:
    from pagedllm.attention.triton_backend import TritonBackend  # imports triton on first use

    return TritonBackend(layout)


_BUILDERS: dict[str, Callable[..., AttentionBackend]] = {
    "torch": _torch, "reference": _reference, "triton": _triton,
}


def select_backend(
    config: AttentionConfig, layout: KVLayout, device: torch.device | str, params: Sequence[AttentionParams]
) -> AttentionBackend:
    """The backend for layers with these features (ValueError naming a feature, or the
    layout, it does not run)."""
    backend = _BUILDERS[config.backend](config, layout, torch.device(device), params)
    for p in set(params):
        backend.check(p)
    return backend


def bind_backend(
    layers: Sequence[Attention], config: AttentionConfig, layout: KVLayout, device: torch.device | str
) -> AttentionBackend:
    """Select one backend for every layer and bind it (each layer's KV cache is bound by
    the KV worker)."""
    backend = select_backend(config, layout, device, [layer.params for layer in layers])
    for layer in layers:
        layer.backend = backend
    return backend


def bind_default_backend(layers: Sequence[Attention], layout: KVLayout, device: torch.device | str) -> None:
    """The default configuration's backend for layers that have none over ``layout`` (a KV
    worker binding caches; the runner then binds the configured one)."""
    unbound = [layer for layer in layers if layer.backend is None or layer.backend.layout is not layout]
    if unbound:
        bind_backend(unbound, AttentionConfig(), layout, device)
