"""HF architecture name -> model class, imported only when that architecture is loaded."""

from __future__ import annotations

import importlib

from torch import nn

# architecture (as in config.json "architectures") -> "module:Class"
_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "pagedllm.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "pagedllm.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "pagedllm.models.llama:LlamaForCausalLM",
    "GPT2LMHeadModel": "pagedllm.models.gpt2:GPT2LMHeadModel",
    "OPTForCausalLM": "pagedllm.models.opt:OPTForCausalLM",
    "Gemma3ForCausalLM": "pagedllm.models.gemma3:Gemma3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(architecture: str) -> type[nn.Module]:
    """The model class for an HF architecture name; ValueError naming the supported ones."""
    target = _MODELS.get(architecture)
    if target is None:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; "
            f"supported: {', '.join(supported_architectures())}"
        )
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)
