"""Shared weight loading: HF-named checkpoint tensors -> a model's parameters.

Each model names its fused parameters (`stacked`: (fused, checkpoint part, shard id)), the
checkpoint entries to skip, and an optional per-tensor `transform` (e.g. GPT-2's Conv1D
transpose); everything else is a name lookup and the parameter's own weight loader.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from pagedllm.layers.utils import get_weight_loader

logger = logging.getLogger(__name__)

StackedParams = Sequence[tuple[str, str, str | int]]
# (name, tensor) -> (name, tensor) to load, or None to skip the tensor
Transform = Callable[[str, torch.Tensor], "tuple[str, torch.Tensor] | None"]


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: StackedParams = (),
    transform: Transform | None = None,
) -> set[str]:
    """Load HF-named tensors; returns the parameter names filled.

    ValueError if a parameter (or a shard of a fused one) got no tensor. A tied weight is
    listed once by named_parameters(), under the module that owns it.
    """
    params = dict(model.named_parameters())
    loaded: set[tuple[str, str | int | None]] = set()  # (parameter, shard)
    for name, tensor in weights:
        if transform is not None:
            item = transform(name, tensor)
            if item is None:
                continue
            name, tensor = item
        shard_id: str | int | None = None
        for fused, part, shard in stacked:
            if f".{part}." in name:
                name, shard_id = name.replace(f".{part}.", f".{fused}."), shard
                break
        param = params.get(name)
        if param is None:
            logger.warning("checkpoint tensor %s has no parameter in the model; skipped", name)
            continue
        get_weight_loader(param)(param, tensor, shard_id)
        loaded.add((name, shard_id))
    expected = set()
    for name in params:
        shards = [shard for fused, _, shard in stacked if f".{fused}." in name] or [None]
        expected |= {(name, shard) for shard in shards}
    missing = sorted(n if s is None else f"{n}[{s}]" for n, s in expected - loaded)
    if missing:
        raise ValueError(f"checkpoint has no tensor for parameters: {', '.join(missing[:8])}")
    return {name for name, _ in loaded}
