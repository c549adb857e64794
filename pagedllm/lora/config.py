"""LoRAConfig: how many adapters one engine serves and how large they may be."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1
    """Distinct adapters in one step (the stacked weights' slots, vLLM's --max-loras)."""
    max_lora_rank: int = 16
    """Largest rank an adapter may have; every slot is padded to it (--max-lora-rank)."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded in host memory, least recently used evicted (default: max_loras)."""

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras={self.max_loras} must be >= 1")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank={self.max_lora_rank} must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras}"
            )

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
