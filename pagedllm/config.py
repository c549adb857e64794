"""Engine configuration: one frozen dataclass per concern, composed into EngineConfig.

No torch here: the control plane (core/) reads these too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

GiB = 1 << 30

DType = Literal["float32", "bfloat16"]

KV_CACHE_BACKENDS = ("paged", "vattention")


def parse_bytes(value: int | str) -> int:
    """Parse a byte count: an int, or a string such as "4GiB", "512MiB", "2GB", "1e9"."""
    if isinstance(value, int):
        return value
    text = str(value).strip()
    m = re.fullmatch(r"(?i)\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?)(i?)b?\s*", text)
    if not m:
        raise ValueError(
            f"kv_cache_memory_bytes={value!r} is not a byte count; "
            "use an integer or a string such as '4GiB', '512MiB' or '2GB'"
        )
    number, unit, binary = m.groups()
    base = 1024 if binary or not unit else 1000
    power = " kmgt".index(unit.lower()) if unit else 0
    return int(float(number) * base**power)


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about the model; built by models.loader."""

    model: str
    """The name or path the user gave."""
    architecture: str
    """The checkpoint's architecture name, e.g. "LlamaForCausalLM"."""
    dtype: DType
    """Compute and KV dtype."""
    max_model_len: int
    """Longest sequence (prompt + output) a request may reach."""
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    eos_token_ids: tuple[int, ...]
    """End-of-sequence ids: the checkpoint's EOS plus end-of-turn ids."""
    bos_token_id: int | None = None
    sliding_window: int | None = None
    """Window of sliding-window layers, None when every layer attends fully."""


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache pool."""

    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory_bytes: int = 4 * GiB
    """Byte budget of the KV pool (as vLLM's CPU backend's default of 4 GiB)."""
    enable_prefix_caching: bool = True
    """Reuse cached KV blocks of shared prompt prefixes."""
    kv_cache_backend: str = "paged"
    """"paged" (blocks and block tables) or "vattention" (per-request contiguous slots of
    reserved address space, pages on demand; no sharing, so no prefix caching or forks)."""

    def __post_init__(self) -> None:
        if self.kv_cache_backend not in KV_CACHE_BACKENDS:
            raise ValueError(
                f"kv_cache_backend={self.kv_cache_backend!r} is not one of {', '.join(KV_CACHE_BACKENDS)}"
            )
        if self.kv_cache_backend == "vattention" and self.enable_prefix_caching:
            raise ValueError(
                "prefix caching shares KV blocks between requests, which the vattention KV backend "
                "cannot (each request owns a contiguous slot); drop enable_prefix_caching=True "
                "(--no-enable-prefix-caching) or use kv_cache_backend='paged'"
            )
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a positive power of two")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} must be > 0")


@dataclass(frozen=True)
class SchedulerConfig:
    """Token and sequence budgets of one engine step."""

    max_num_batched_tokens: int = 2048
    """Most tokens (prefill chunks + decodes) in one step."""
    max_num_seqs: int = 128
    """Most requests running at once."""
    max_model_len: int = 2048
    """Longest sequence a request may reach (copied from ModelConfig)."""

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be > 0")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be > 0")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be at least "
                f"max_num_seqs={self.max_num_seqs} so every running request can decode each step"
            )


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    num_blocks: int
    """Blocks in the KV pool, including the reserved null block 0."""
    seed: int = 0
    """Seed of the engine's global generator (requests without their own seed)."""
