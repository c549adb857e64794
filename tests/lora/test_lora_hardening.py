"""One bad LoRA adapter cannot poison anyone (issue 48, item 2): configs and weights checked
in full at registration (torch-free, a LoRAAdapterError naming why), and a slot holding NaN
weights (put there behind the checks' back) leaves every other row of the batch exact."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm.lora.checkpoint import LoRAAdapterError, LoRAModuleWeights, check_adapter_files, load_peft_adapter
from pagedllm.lora.layers import LinearLoRASlots, LoRAMapping, slot_groups
from pagedllm.lora.registry import LoRARegistry
from pagedllm.lora.request import LoRARequest
from tests.lora.utils import save_random_adapter, save_tiny_llama
from tests.utils import assert_greedy_match, hf_greedy


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lora-hardening")
    base = save_tiny_llama(root / "base")
    merged = save_random_adapter(base, root / "a", seed=1, r=4, targets=("q_proj", "v_proj", "down_proj"))
    return {"root": root, "base": base, "a": merged}


def variant(root: Path, name: str, config: dict | None = None, poison: str | None = None,
            dtype: torch.dtype | None = None) -> Path:
    """Adapter a's files under ``name``, its config updated (a None value drops the key), a
    weight poisoned (``poison``: "nan" or "inf" in the first B) or stored in ``dtype``."""
    from safetensors.torch import load_file, save_file

    target = root / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(root / "a", target)
    if config is not None:
        data = json.loads((target / "adapter_config.json").read_text())
        for key, value in config.items():
            if value is None:
                data.pop(key, None)
            else:
                data[key] = value
        (target / "adapter_config.json").write_text(json.dumps(data))
    if poison is not None or dtype is not None:
        tensors = load_file(str(target / "adapter_model.safetensors"))
        if poison is not None:
            key = next(k for k in sorted(tensors) if "lora_B" in k)
            tensors[key][0, 0] = float(poison)
        if dtype is not None:
            tensors = {k: v.to(dtype) for k, v in tensors.items()}
        save_file(tensors, str(target / "adapter_model.safetensors"))
    return target


@pytest.mark.parametrize("config, text", [
    ({"r": 0}, "r=0 must be an integer >= 1"), ({"r": None}, "r=None"), ({"r": [4]}, r"r=\[4\]"),
    ({"r": "4"}, "r='4'"), ({"r": 4.0}, "r=4.0"), ({"r": True}, "r=True"),
    ({"lora_alpha": float("nan")}, "lora_alpha=nan"), ({"lora_alpha": float("inf")}, "lora_alpha=inf"),
    ({"lora_alpha": 0}, "lora_alpha=0"), ({"lora_alpha": -8}, "lora_alpha=-8"),
    ({"lora_alpha": "8"}, "lora_alpha='8'"), ({"use_rslora": "yes"}, "use_rslora"),
])
def test_bad_configs_are_refused_by_name(checkpoints, config, text):
    path = variant(checkpoints["root"], "cfg", config)
    registry = LoRARegistry(max_lora_rank=8)
    with pytest.raises(LoRAAdapterError, match=text):
        registry.add("bad", str(path))
    assert registry.adapters() == []


@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_non_finite_weights_are_refused_at_registration(checkpoints, poison):
    path = variant(checkpoints["root"], f"w-{poison}", poison=poison)
    registry = LoRARegistry(max_lora_rank=8)
    with pytest.raises(LoRAAdapterError, match="NaN or infinite"):
        registry.add("bad", str(path))
    assert registry.adapters() == []
    with pytest.raises(LoRAAdapterError, match="NaN or infinite"):  # the engine's own load checks too
        load_peft_adapter(LoRARequest("bad", 1, str(path)), 8)


def test_huge_alpha_overflowing_the_scaled_weights_is_refused(checkpoints):
    path = variant(checkpoints["root"], "alpha", {"lora_alpha": 1e300})
    with pytest.raises(LoRAAdapterError, match="NaN or infinite"):
        check_adapter_files(LoRARequest("big", 1, str(path)), 8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_free_check_reads_half_precision(checkpoints, dtype):
    path = variant(checkpoints["root"], f"half-{dtype}", dtype=dtype)
    from safetensors.torch import load_file

    from pagedllm.lora.checkpoint import _read_safetensors

    assert check_adapter_files(LoRARequest("half", 1, str(path)), 8) == (4, 4.0)
    theirs = load_file(str(path / "adapter_model.safetensors"))
    ours = _read_safetensors("half", str(path / "adapter_model.safetensors"))
    assert set(ours) == set(theirs)
    for key, tensor in theirs.items():
        assert torch.equal(torch.from_numpy(ours[key].copy()), tensor.float())


def test_poisoned_slot_cannot_reach_other_rows():
    """Slot 1 full of NaN: rows of slot 0 get exactly their delta, rows without an adapter
    keep the base output bit for bit."""
    torch.manual_seed(0)
    slots = LinearLoRASlots(8, {None: (0, 6)}, max_loras=2, max_rank=2, dtype=torch.float32)
    a, b = torch.randn(2, 8), torch.randn(6, 2)
    slots.set_slot(0, {None: LoRAModuleWeights(a, b)})
    slots.lora_a[2:4] = float("nan")
    slots.lora_b[2:4] = float("nan")
    x, y = torch.randn(4, 8), torch.randn(4, 6)
    row_slots = torch.tensor([-1, 0, 1, -1])
    one_hot = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    for mapping in (LoRAMapping(one_hot, row_slots, slot_groups(row_slots)), LoRAMapping(one_hot, row_slots)):
        out = slots.add_delta(x, y, mapping)
        assert torch.equal(out[[0, 3]], y[[0, 3]])
        torch.testing.assert_close(out[1], y[1] + (x[1] @ a.t()) @ b.t())
        assert out[2].isnan().all()  # the poisoned adapter's own row


def test_base_requests_beside_a_poisoned_slot_match_the_base(checkpoints):
    """The engine, with a good adapter in one slot and NaN weights forced into the other:
    base requests in the same batch still decode as the base model, and the good adapter's
    as the adapter (both by the tie-aware greedy rule against HF)."""
    from pagedllm import LLM, SamplingParams

    root = checkpoints["root"]
    llm = LLM(str(root / "base"), enable_lora=True, max_loras=2, max_lora_rank=4, dtype="float32",
              kv_cache_memory_bytes="16MiB", max_model_len=256)
    good = LoRARequest("a", 1, str(root / "a"))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(["warm up"], params, lora_request=good, use_tqdm=False)  # a takes a slot
    manager = llm.llm_engine.engine_core.runner.lora_manager
    poisoned = 1 - manager.slot_of(good.lora_int_id)
    for layer in manager.layers.values():
        slots = layer.lora_slots
        span = slice(poisoned * slots.width, (poisoned + 1) * slots.width)
        slots.lora_a[span] = float("nan")
        slots.lora_b[span] = float("nan")
    prompts = ["Hello, my name is", "The quick brown fox", "Once upon a time"]
    loras = [None, good, None]
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    for out, request in zip(outs, loras):
        ref_model = checkpoints["base"] if request is None else checkpoints["a"]
        ref, gaps = hf_greedy(ref_model, out.prompt_token_ids, 8)
        assert_greedy_match(out.outputs[0].token_ids, ref, gaps, f"{out.prompt!r} under {request}")
