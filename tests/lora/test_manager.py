"""LoRAManager without an engine: slots refilled only when their adapter changes, the host
cache's LRU eviction beyond max_cpu_loras (never of an adapter an unfinished request pins),
removal (deferred while pinned), the mapping; no file read inside a step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.manager import LoRAManager
from pagedllm.lora.request import LoRARequest
from pagedllm.models.llama import PACKED_MODULES
from pagedllm.models.loader import load_model
from tests.lora.utils import save_random_adapter, save_tiny_llama


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    root: Path = tmp_path_factory.mktemp("lora-manager")
    base = save_tiny_llama(root / "base")
    adapters = []
    for i in range(3):
        save_random_adapter(base, root / f"a{i}", seed=i, r=4, targets=("q_proj", "down_proj"))
        adapters.append(LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")))
    return load_model(str(root / "base"), dtype="float32").model, adapters


def _manager(model, slots: int):
    """A manager with `slots` adapter slots and as many host-cached adapters; layer 0's QKV slots."""
    manager = LoRAManager(model, LoRAConfig(max_loras=slots, max_lora_rank=4, max_cpu_loras=slots), PACKED_MODULES,
                          torch.float32)
    return manager, model.model.layers[0].self_attn.qkv_proj.lora_slots


def test_slots_and_host_cache(setup) -> None:
    model, (a0, a1, a2) = setup
    manager, qkv = _manager(model, slots=2)
    manager.add_adapter(a0)
    manager.add_adapter(a1)
    mapping = manager.prepare([a0, None, a1], np.array([2, 1, 3]))
    assert mapping.row_slots.tolist() == [0, 0, -1, 1, 1, 1]
    assert mapping.one_hot.tolist() == [[1, 0], [1, 0], [0, 0], [0, 1], [0, 1], [0, 1]]
    # q_proj's section of the QKV holds a0's A in slot 0; k and v (not adapted) stay zero.
    width = qkv.width
    assert qkv.lora_a[:4].abs().sum() > 0 and qkv.lora_a[4:width].abs().sum() == 0
    assert qkv.lora_b[:width, qkv.sections["q"][1]:].abs().sum() == 0
    # A third adapter: the host cache (2) evicts the least recently used one not in a slot;
    # both are in slots, so it grows past capacity rather than drop a slot's adapter.
    manager.add_adapter(a2)
    assert set(manager.loaded_ids()) == {1, 2, 3}
    # a2 takes the least recently used slot (a0's, used before a1), a0 is then evictable.
    mapping = manager.prepare([a2, a1], np.array([1, 1]))
    assert mapping.row_slots.tolist() == [0, 1]
    manager.add_adapter(a0)  # already loaded: now the most recently used
    assert manager.remove_adapter(3) and not manager.remove_adapter(3)
    assert qkv.lora_a[:width].abs().sum() == 0  # a2's slot cleared
    # Back at capacity (a1 in slot 1, a0 in none): adding a2 evicts a0, the least recently
    # used adapter held in no slot, not a1 (older, but in a slot).
    manager.add_adapter(a2)
    assert set(manager.loaded_ids()) == {2, 3}
    manager.remove_adapter(2)
    manager.remove_adapter(3)
    assert manager.loaded_ids() == []
    # A step never reads an adapter's files (a request's add does, and pins it till it ends).
    with pytest.raises(RuntimeError, match="not loaded"):
        manager.prepare([a1], np.array([1]))
    manager.add_adapter(a1)
    assert manager.prepare([a1], np.array([1])).row_slots.tolist() == [0]
    assert manager.loaded_ids() == [2]
    assert manager.prepare([None, None], np.array([1, 1])) is None


def test_pins_hold_adapters_through_eviction_and_unload(setup) -> None:
    model, (a0, a1, a2) = setup
    manager, qkv = _manager(model, slots=1)
    manager.add_adapter(a0)
    manager.pin("r0", a0.lora_int_id)
    manager.add_adapter(a1)  # capacity 1, but a0 is pinned by r0: not evicted
    assert set(manager.loaded_ids()) == {1, 2}
    manager.prepare([a0], np.array([1]))
    assert manager.remove_adapter(a0.lora_int_id)  # unloaded while r0 runs: kept until it ends
    assert 1 in manager.loaded_ids() and qkv.lora_a[: qkv.width].abs().sum() > 0
    manager.unpin(["r0"])
    assert 1 not in manager.loaded_ids() and qkv.lora_a[: qkv.width].abs().sum() == 0  # slot freed
    manager.remove_adapter(a1.lora_int_id)
    assert manager.loaded_ids() == []

