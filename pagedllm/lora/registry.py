"""The server's adapters by name: --lora-modules at start, /v1/load_lora_adapter at run time.

Torch-free (the API server process imports it). Each registration gets a fresh
``lora_int_id``, so an adapter unloaded and loaded again under the same name (perhaps from
other files) never shares the prefix cache, or a loaded copy in the engine core, with the old.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable

from pagedllm.lora.checkpoint import check_adapter_files
from pagedllm.lora.request import LoRARequest


def parse_lora_module(text: str) -> dict:
    """One --lora-modules value: `name=path`, or vLLM's JSON form
    `{"name": ..., "path": ..., "base_model_name": ...}`."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {text!r} is not valid JSON ({e})") from None
        if not isinstance(value, dict) or not {"name", "path"} <= set(value) or set(value) - {
            "name", "path", "base_model_name"
        }:
            raise ValueError(f"--lora-modules {text!r}: a JSON object with name, path and optionally base_model_name")
        return value
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r} is not name=path (or the JSON form)")
    return {"name": name, "path": path}


class LoRARegistry:
    def __init__(self, max_lora_rank: int, reserved_names: Iterable[str] = ()) -> None:
        """``reserved_names``: the base model's served names (an adapter may not take one)."""
        self.max_lora_rank = max_lora_rank
        self._reserved = frozenset(reserved_names)
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Register an adapter after checking its files (ValueError naming what is wrong)."""
        return self.commit(self.prepare(name, path, base_model_name))

    def prepare(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check a name and an adapter's files in full (the config's types, every weight
        finite and of the rank; reads the weights: call it off the event loop), without
        registering it; ValueError naming what is wrong."""
        self._check_name(name)
        request = LoRARequest(name, next(self._ids), path, base_model_name)
        check_adapter_files(request, self.max_lora_rank)
        return request

    def commit(self, request: LoRARequest) -> LoRARequest:
        """Register a prepared adapter (listed and usable from now on)."""
        self._check_name(request.lora_name)
        self._by_name[request.lora_name] = request
        return request

    def _check_name(self, name: str) -> None:
        if name in self._reserved:
            raise ValueError(f"LoRA adapter name {name!r} is the base model's name")
        if name in self._by_name:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")

    def remove(self, name: str) -> LoRARequest:
        request = self._by_name.pop(name, None)
        if request is None:
            raise KeyError(name)
        return request

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def adapters(self) -> list[LoRARequest]:
        return list(self._by_name.values())
