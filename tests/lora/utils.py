"""Tiny Llama checkpoints and random PEFT adapters made with peft itself, for the LoRA tests."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

from tests.models.utils import TINY_BOS_ID, TINY_EOS_ID, save_tiny_model


def tiny_llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    fields = dict(
        vocab_size=262, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID, tie_word_embeddings=False,
    )  # fmt: skip
    fields.update(overrides)
    return LlamaConfig(**fields)


def save_tiny_llama(path: str | os.PathLike[str], seed: int = 0, **overrides: Any) -> Any:
    """A random tiny Llama saved as safetensors (+ the tiny tokenizer); returns the HF model."""
    return save_tiny_model(path, tiny_llama_config(**overrides), seed=seed)


def save_random_adapter(
    base: Any, path: str | os.PathLike[str], seed: int, r: int = 8, alpha: float = 16,
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    **config: Any,
) -> Any:
    """A PEFT LoRA on a copy of `base` with random A and B (a non-zero delta), saved to `path`;
    returns the HF model with the adapter merged into its weights (the reference)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    lora_config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False, **config)
    peft_model = get_peft_model(copy.deepcopy(base), lora_config)
    with torch.no_grad():  # B of PEFT's random init is small; widen it so the delta matters
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.3 * torch.randn_like(param))
    peft_model.save_pretrained(str(path))
    return peft_model.merge_and_unload().eval()
