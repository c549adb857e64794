"""Small helpers shared by the layers: weight loading and construction dtype."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from pagedllm.kernels import clear_weight_caches

WeightLoader = Callable[..., None]


def default_weight_loader(
    param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None
) -> None:
    """Copy a whole checkpoint tensor into `param` (casting to the parameter's dtype)."""
    assert shard_id is None, f"parameter without shards got shard_id={shard_id!r}"
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded_weight.shape)} does not fit "
            f"parameter of shape {tuple(param.shape)}"
        )
    param.data.copy_(loaded_weight)
    clear_weight_caches()


def set_weight_loader(param: torch.nn.Parameter, loader: WeightLoader) -> None:
    """Attach `loader(param, loaded_weight, shard_id=None)` to a parameter."""
    param.weight_loader = loader  # type: ignore[attr-defined]


def get_weight_loader(param: torch.nn.Parameter) -> WeightLoader:
    return getattr(param, "weight_loader", default_weight_loader)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create floating-point parameters directly in `dtype` (no float32 copy first)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)
