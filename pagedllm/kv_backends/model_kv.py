"""What every KV backend reads off a loaded model (worker side, torch): its Attention layers
and the bytes of one token's K (or V) in one layer. Imported by a backend's ``build`` and
worker, never by its manager side."""

from __future__ import annotations

from torch import nn

from pagedllm.config import ModelConfig, resolve_kv_cache_dtype
from pagedllm.layers.attention import Attention
from pagedllm.layers.kv_quant import row_bytes


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def kv_token_bytes(model_config: ModelConfig, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one token's K (or V) in one layer: num_kv_heads rows of the storage's width
    (8-bit codes plus a float32 scale per row for a quantized cache, layers/kv_quant.py)."""
    storage = resolve_kv_cache_dtype(kv_cache_dtype, model_config.dtype)
    return model_config.num_kv_heads * row_bytes(storage, model_config.head_dim)
