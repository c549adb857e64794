"""The worker's adapters: loaded in host memory (LRU, `max_cpu_loras`) and active in slots.

`LoRAManager` attaches a `LinearLoRASlots` to every adaptable Linear of the model (those under
the decoder layers), checks each adapter against the model's shapes when it is added, and
before every forward puts the step's adapters into slots (at most `max_loras`; the scheduler
never schedules more) and builds the step's per-token `LoRAMapping`. A slot is refilled only
when its adapter changes; an adapter loaded in no slot may be evicted from host memory.

Files are read only in ``add_adapter`` (a registration, or a request's add), never inside a
step: every unfinished request pins its adapter (``pin`` / ``unpin``), and a pinned adapter
is neither evicted nor, when unloaded (``remove_adapter``), dropped before its last request
ends; ``prepare`` never reads.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from pagedllm.layers.linear import Linear
from pagedllm.lora.checkpoint import LoRAAdapter, LoRAAdapterError, LoRAModuleWeights, load_peft_adapter
from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.layers import LinearLoRASlots, LoRAMapping, slot_groups
from pagedllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)

PackedModules = Sequence[tuple[str, str, object]]  # (fused parameter, checkpoint projection, shard id)


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, packed_modules: PackedModules,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        # checkpoint projection name -> (fused parameter name, shard id)
        self._packed = {ckpt: (fused, shard) for fused, ckpt, shard in packed_modules}
        self.layers: dict[str, Linear] = {}
        for name, module in model.named_modules():
            if isinstance(module, Linear) and ".layers." in f".{name}":
                tp = getattr(module, "tp", None)
                if tp is not None and tp.size > 1:
                    raise ValueError("LoRA adapters run in one process only (--tensor-parallel-size 1)")
                module.lora_slots = LinearLoRASlots(
                    module.in_features, module.output_sections(), config.max_loras, config.max_lora_rank, dtype, device)
                self.layers[name] = module
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no decoder-layer projections to adapt")
        self._cpu: OrderedDict[int, tuple[LoRAAdapter, dict[str, dict[object, LoRAModuleWeights]]]] = OrderedDict()
        self._slots: list[int | None] = [None] * config.max_loras  # adapter id per slot
        self._slot_use: OrderedDict[int, None] = OrderedDict((i, None) for i in range(config.max_loras))
        self._pins: dict[str, int] = {}  # unfinished request id -> its adapter id
        self._pin_counts: dict[int, int] = {}
        self._removed: set[int] = set()  # unloaded, kept until their last request ends

    # ---- adapters in host memory -------------------------------------------------------

    def add_adapter(self, request: LoRARequest) -> None:
        """Load and check `request`'s adapter (a no-op when loaded); ValueError if refused."""
        if request.lora_int_id in self._cpu:
            self._cpu.move_to_end(request.lora_int_id)
            return
        try:
            adapter = load_peft_adapter(request, self.config.max_lora_rank)
            placed = self._place(adapter)
        except (OSError, ValueError) as e:
            message = str(e) if isinstance(e, LoRAAdapterError) else f"LoRA adapter {request.lora_name!r}: {e}"
            raise LoRAAdapterError(message) from None
        while len(self._cpu) >= self.config.cpu_capacity and self._evict_one():
            pass
        self._cpu[request.lora_int_id] = (adapter, placed)
        logger.info("LoRA adapter %s (id %d, rank %d, %d projections) loaded",
                    request.lora_name, request.lora_int_id, adapter.rank, len(adapter.modules))

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget an adapter (and free its slot); False when it was not loaded. One that
        unfinished requests still use goes once the last of them ends."""
        if lora_int_id not in self._cpu:
            return False
        if self._pin_counts.get(lora_int_id):
            self._removed.add(lora_int_id)
            return True
        self._drop(lora_int_id)
        return True

    def _drop(self, lora_int_id: int) -> None:
        self._removed.discard(lora_int_id)
        slot = None
        if lora_int_id in self._slots:
            slot = self._slots.index(lora_int_id)
            for layer in self.layers.values():
                layer.lora_slots.clear_slot(slot)  # type: ignore[union-attr]
            self._slots[slot] = None
        self._cpu.pop(lora_int_id, None)
        logger.info("LoRA adapter id %d unloaded (slot %s freed)", lora_int_id, slot)

    def pin(self, request_id: str, lora_int_id: int) -> None:
        """An unfinished request uses this (loaded) adapter: keep it until ``unpin``."""
        if request_id in self._pins:
            return
        self._pins[request_id] = lora_int_id
        self._pin_counts[lora_int_id] = self._pin_counts.get(lora_int_id, 0) + 1

    def unpin(self, request_ids) -> None:
        """These requests ended (unknown ids are ignored)."""
        for request_id in request_ids:
            adapter_id = self._pins.pop(request_id, None)
            if adapter_id is None:
                continue
            self._pin_counts[adapter_id] -= 1
            if not self._pin_counts[adapter_id]:
                del self._pin_counts[adapter_id]
                if adapter_id in self._removed:
                    self._drop(adapter_id)

    def slot_of(self, lora_int_id: int) -> int | None:
        return self._slots.index(lora_int_id) if lora_int_id in self._slots else None

    def loaded_ids(self) -> list[int]:
        return list(self._cpu)

    def _evict_one(self) -> bool:
        """Drop the least recently used adapter held in no slot; False if every one is."""
        for adapter_id in self._cpu:
            if adapter_id not in self._slots and not self._pin_counts.get(adapter_id):
                del self._cpu[adapter_id]
                logger.info("LoRA adapter id %d evicted from host memory (max_cpu_loras)", adapter_id)
                return True
        return False

    def _place(self, adapter: LoRAAdapter) -> dict[str, dict[object, LoRAModuleWeights]]:
        """The adapter's weights by our layer name and section, checked against their shapes."""
        name = adapter.request.lora_name
        placed: dict[str, dict[object, LoRAModuleWeights]] = {}
        for module, weights in adapter.modules.items():
            prefix, _, proj = module.rpartition(".")
            fused, shard = self._packed.get(proj, (proj, None))
            target = f"{prefix}.{fused}" if prefix else fused
            layer = self.layers.get(target)
            if layer is None:
                raise ValueError(f"LoRA adapter {name!r}: the base model has no adaptable projection {module!r}")
            offset_size = layer.lora_slots.sections.get(shard)  # type: ignore[union-attr]
            if offset_size is None:
                raise ValueError(f"LoRA adapter {name!r}: {module!r} does not match the base's {target}")
            rows, cols = weights.lora_b.shape[0], weights.lora_a.shape[1]
            if rows != offset_size[1] or cols != layer.in_features:
                raise ValueError(
                    f"LoRA adapter {name!r}: {module} adapts a [{rows}, {cols}] weight, but the base "
                    f"model's is [{offset_size[1]}, {layer.in_features}] (an adapter of another base?)"
                )
            placed.setdefault(target, {})[shard] = weights
        return placed

    # ---- one step ----------------------------------------------------------------------

    def prepare(self, lora_requests: Sequence[LoRARequest | None], counts: np.ndarray) -> LoRAMapping | None:
        """Slots for the step's adapters; the mapping of its tokens (`counts[i]` tokens of
        request i, whose adapter is `lora_requests[i]`), None when no request has one."""
        if all(r is None for r in lora_requests):
            return None
        slot_of: dict[int, int] = {}
        for request in dict.fromkeys(r for r in lora_requests if r is not None):
            if request.lora_int_id not in self._cpu:  # pinned while unfinished: never the case
                raise RuntimeError(f"LoRA adapter {request.lora_name!r} (id {request.lora_int_id}) is not loaded")
            slot_of[request.lora_int_id] = self._activate(request.lora_int_id, set(slot_of.values()))
        lora_ids = [None if r is None else r.lora_int_id for r in lora_requests]
        slot_per_req = np.asarray([-1 if i is None else slot_of[i] for i in lora_ids], dtype=np.int64)
        slot_per_token = torch.from_numpy(np.repeat(slot_per_req, counts))  # [T], -1: none
        one_hot = torch.zeros(len(slot_per_token), self.config.max_loras + 1, dtype=self.dtype)
        one_hot[torch.arange(len(slot_per_token)), slot_per_token] = 1  # -1 lands in the spare column
        row_slots = slot_per_token.to(self.device)
        return LoRAMapping(one_hot[:, : self.config.max_loras].to(self.device), row_slots, slot_groups(row_slots))

    def _activate(self, adapter_id: int, taken: set[int]) -> int:
        """The slot holding `adapter_id`, filling the least recently used free one if none."""
        if adapter_id in self._slots:
            slot = self._slots.index(adapter_id)
        else:
            slot = next(s for s in self._slot_use if s not in taken)
            placed = self._cpu[adapter_id][1]
            for name, layer in self.layers.items():
                layer.lora_slots.set_slot(slot, placed.get(name, {}))  # type: ignore[union-attr]
            self._slots[slot] = adapter_id
        self._slot_use.move_to_end(slot)
        self._cpu.move_to_end(adapter_id)
        return slot
