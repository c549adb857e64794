"""PEFT LoRA checkpoints: adapter_config.json + adapter_model.safetensors -> per-module (A, B).

A PEFT LoRA on a linear W [N, K] adds scaling * B A x, A: [r, K], B: [N, r], with scaling
alpha / r (alpha / sqrt(r) under rsLoRA). The scaling is folded into B here, once at load.
What this engine does not compute is refused here, at load, with the reason: DoRA, adapters on
embeddings or the LM head, ``modules_to_save`` (whole replaced modules), per-module rank or
alpha patterns, trained biases, and ranks above ``max_lora_rank``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.lora.request import LoRARequest

if TYPE_CHECKING:
    import torch

_CONFIG = "adapter_config.json"
_WEIGHTS = "adapter_model.safetensors"
_REFUSED_TARGETS = ("embed_tokens", "lm_head", "wte", "embed_out")


@dataclass(frozen=True)
class LoRAModuleWeights:
    """One adapted checkpoint projection (HF name, e.g. model.layers.0.self_attn.q_proj)."""

    lora_a: torch.Tensor  # [r, K]
    lora_b: torch.Tensor  # [N, r], scaling folded in

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass(frozen=True)
class LoRAAdapter:
    request: LoRARequest
    rank: int
    scaling: float
    modules: dict[str, LoRAModuleWeights]
    """HF projection name (no PEFT prefix) -> its weights."""


def check_adapter_dir(request: LoRARequest, max_lora_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a PEFT LoRA directory whose config this engine runs, without reading
    the weights (torch-free: the API server checks adapters with it); ValueError otherwise."""
    path = request.lora_path
    config_file = os.path.join(path, _CONFIG)
    if not os.path.isfile(config_file):
        raise ValueError(f"LoRA adapter {request.lora_name!r}: no {_CONFIG} in {path!r}")
    with open(config_file) as f:
        config = json.load(f)
    rank_scaling = _check_config(request.lora_name, config, max_lora_rank)
    if not os.path.isfile(os.path.join(path, _WEIGHTS)):
        raise ValueError(f"LoRA adapter {request.lora_name!r}: no {_WEIGHTS} in {path!r} (only safetensors is read)")
    return rank_scaling


def load_peft_adapter(request: LoRARequest, max_lora_rank: int) -> LoRAAdapter:
    """Read and check a PEFT LoRA directory; ValueError naming what is refused and why."""
    rank, scaling = check_adapter_dir(request, max_lora_rank)
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(request.lora_path, _WEIGHTS))
    return LoRAAdapter(request, rank, scaling, _pair_tensors(request.lora_name, tensors, rank, scaling))


def _check_config(name: str, config: dict, max_lora_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a config this engine computes exactly."""
    def refuse(why: str) -> ValueError:
        return ValueError(f"LoRA adapter {name!r}: {why}")

    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type={config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        raise refuse("DoRA (use_dora=true) is not supported: its magnitude vector rescales each weight row")
    if config.get("modules_to_save"):
        raise refuse(f"modules_to_save={config['modules_to_save']!r} replaces whole modules; not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise refuse("per-module rank_pattern / alpha_pattern are not supported (one r and lora_alpha)")
    if config.get("bias", "none") != "none":
        raise refuse(f"bias={config['bias']!r}: trained biases are not supported")
    if config.get("fan_in_fan_out"):
        raise refuse("fan_in_fan_out=true (Conv1D layers) is not supported")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    refused = [t for t in targets if any(r in t for r in _REFUSED_TARGETS)]
    if refused:
        raise refuse(f"adapters on embeddings or the LM head ({', '.join(refused)}) are not supported")
    rank = int(config["r"])
    if rank > max_lora_rank:
        raise refuse(f"rank {rank} is above max_lora_rank={max_lora_rank} (--max-lora-rank)")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scaling


def _pair_tensors(
    name: str, tensors: dict[str, torch.Tensor], rank: int, scaling: float
) -> dict[str, LoRAModuleWeights]:
    """PEFT's `base_model.model.<module>.lora_{A,B}.weight` pairs by HF module name."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, kind = key.removeprefix("base_model.model.").rpartition(".lora_")
        if not module or kind not in ("A.weight", "B.weight"):
            if "lora_embedding" in key or any(f".{r}." in f".{key}." for r in _REFUSED_TARGETS):
                raise ValueError(f"LoRA adapter {name!r}: adapters on embeddings or the LM head ({key}) are not supported")
            raise ValueError(f"LoRA adapter {name!r}: unexpected tensor {key!r} (not a lora_A/lora_B weight)")
        parts.setdefault(module, {})[kind[0]] = tensor
    modules: dict[str, LoRAModuleWeights] = {}
    for module, pair in parts.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: {module} has lora_{''.join(pair)} but not its pair")
        a, b = pair["A"].float(), pair["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(
                f"LoRA adapter {name!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, not rank {rank}"
            )
        modules[module] = LoRAModuleWeights(a.contiguous(), (b * scaling).contiguous())
    if not modules:
        raise ValueError(f"LoRA adapter {name!r}: the checkpoint holds no LoRA weights")
    return modules
