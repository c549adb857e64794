"""LoRARequest: which adapter a request runs with (vLLM's field names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, id and path; requests with equal ids share one loaded adapter.

    ``lora_int_id`` is a positive integer unique per adapter (vLLM's rule: 0 would be the base);
    ``lora_path`` a directory with PEFT's adapter_config.json and adapter_model.safetensors.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    """The model the adapter was trained on, as /v1/models reports it (None: the served base)."""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    def cache_key(self) -> tuple:
        """What the prefix cache folds into a request's first block hash: KV computed under one
        adapter is never served to another (or to the base)."""
        return ("lora", self.lora_int_id, self.lora_name, self.lora_path)
