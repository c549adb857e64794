"""PEFT LoRA checkpoints: adapter_config.json + adapter_model.safetensors -> per-module (A, B).

A PEFT LoRA on a linear W [N, K] adds scaling * B A x, A: [r, K], B: [N, r], with scaling
alpha / r (alpha / sqrt(r) under rsLoRA). The scaling is folded into B here, once at load.
What this engine does not compute is refused here, at load, with the reason: DoRA, adapters on
embeddings or the LM head, ``modules_to_save`` (whole replaced modules), per-module rank or
alpha patterns, trained biases, and ranks above ``max_lora_rank``. An adapter is checked in
full when it is registered (``check_adapter_dir``, torch-free: the config's types, and every
weight read, paired, of its rank and finite) and again where the engine loads it (the shapes
against the base model: lora/manager.py); a refusal is a ``LoRAAdapterError`` (a 400).
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
_FLOAT_DTYPES = {"F16": "<f2", "F32": "<f4", "F64": "<f8"}


class LoRAAdapterError(ValueError):
    """An adapter this engine refuses (a 400 naming why)."""


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
        raise LoRAAdapterError(f"LoRA adapter {request.lora_name!r}: no {_CONFIG} in {path!r}")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"LoRA adapter {request.lora_name!r}: {_CONFIG} is not readable JSON ({e})") from None
    rank_scaling = _check_config(request.lora_name, config, max_lora_rank)
    if not os.path.isfile(os.path.join(path, _WEIGHTS)):
        raise LoRAAdapterError(
            f"LoRA adapter {request.lora_name!r}: no {_WEIGHTS} in {path!r} (only safetensors is read)")
    return rank_scaling


def check_adapter_files(request: LoRARequest, max_lora_rank: int) -> tuple[int, float]:
    """``check_adapter_dir`` and every weight read (torch-free, with numpy): A/B pairs of
    the config's rank, all finite, scaled B finite too. Reads the whole file: call it off the
    event loop."""
    rank, scaling = check_adapter_dir(request, max_lora_rank)
    tensors = _read_safetensors(request.lora_name, os.path.join(request.lora_path, _WEIGHTS))
    _pair_tensors(request.lora_name, tensors, rank, scaling)
    return rank, scaling


def _read_safetensors(name: str, path: str) -> dict:
    """A safetensors file's float tensors as float32 numpy arrays (bf16 widened exactly)."""
    import numpy as np

    def refuse(why: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"LoRA adapter {name!r}: {_WEIGHTS} {why}")

    with open(path, "rb") as f:
        data = f.read()
    try:
        (header_len,) = np.frombuffer(data[:8], dtype="<u8")
        header = json.loads(data[8 : 8 + int(header_len)])
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
    except ValueError as e:
        raise refuse(f"is not a safetensors file ({e})") from None
    body = memoryview(data)[8 + int(header_len):]
    tensors = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
            if dtype == "BF16":
                raw = np.frombuffer(body[start:end], dtype="<u2").astype(np.uint32) << 16
                array = raw.view(np.float32)
            elif dtype in _FLOAT_DTYPES:
                array = np.frombuffer(body[start:end], dtype=_FLOAT_DTYPES[dtype]).astype(np.float32)
            else:
                raise refuse(f"holds {key} as {dtype}; LoRA weights must be floating point")
            tensors[key] = array.reshape(shape)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, LoRAAdapterError):
                raise
            raise refuse(f"has a malformed entry {key!r} ({e})") from None
    return tensors


def load_peft_adapter(request: LoRARequest, max_lora_rank: int) -> LoRAAdapter:
    """Read and check a PEFT LoRA directory; ValueError naming what is refused and why."""
    rank, scaling = check_adapter_dir(request, max_lora_rank)
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(request.lora_path, _WEIGHTS))
    return LoRAAdapter(request, rank, scaling, _pair_tensors(request.lora_name, tensors, rank, scaling))


def _check_config(name: str, config: dict, max_lora_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a config this engine computes exactly."""
    def refuse(why: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"LoRA adapter {name!r}: {why}")

    if not isinstance(config, dict):
        raise refuse(f"{_CONFIG} is not a JSON object")

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
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise refuse(f"r={rank!r} must be an integer >= 1 (the rank)")
    if rank > max_lora_rank:
        raise refuse(f"rank {rank} is above max_lora_rank={max_lora_rank} (--max-lora-rank)")
    alpha = config.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise refuse(f"lora_alpha={alpha!r} must be a finite number > 0")
    if not isinstance(config.get("use_rslora", False), bool):
        raise refuse(f"use_rslora={config['use_rslora']!r} must be true or false")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _pair_tensors(name: str, tensors: dict, rank: int, scaling: float) -> dict[str, LoRAModuleWeights]:
    """PEFT's `base_model.model.<module>.lora_{A,B}.weight` pairs by HF module name, checked
    (2-D, of the rank, finite); torch tensors or (the torch-free check) numpy arrays."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, kind = key.removeprefix("base_model.model.").rpartition(".lora_")
        if not module or kind not in ("A.weight", "B.weight"):
            if "lora_embedding" in key or any(f".{r}." in f".{key}." for r in _REFUSED_TARGETS):
                raise LoRAAdapterError(
                    f"LoRA adapter {name!r}: adapters on embeddings or the LM head ({key}) are not supported")
            raise LoRAAdapterError(f"LoRA adapter {name!r}: unexpected tensor {key!r} (not a lora_A/lora_B weight)")
        parts.setdefault(module, {})[kind[0]] = tensor
    modules: dict[str, LoRAModuleWeights] = {}
    for module, pair in parts.items():
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {module} has lora_{''.join(pair)} but not its pair")
        a, b = pair["A"], pair["B"]
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, not rank {rank}"
            )
        if hasattr(a, "float"):  # torch
            a, b = a.float(), b.float() * scaling
            finite = bool(a.isfinite().all()) and bool(b.isfinite().all())
        else:  # numpy
            import numpy as np

            with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused just below
                b = b * np.float32(scaling)
            finite = bool(np.isfinite(a).all()) and bool(np.isfinite(b).all())
        if not finite:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {module} has weights that are NaN or infinite "
                                   "(after scaling by lora_alpha / r)")
        modules[module] = LoRAModuleWeights(a if not hasattr(a, "contiguous") else a.contiguous(),
                                            b if not hasattr(b, "contiguous") else b.contiguous())
    if not modules:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: the checkpoint holds no LoRA weights")
    return modules
