"""A tiny Llama whose greedy output is fixed by its weights: "hello world</think>" again and
again, so tests can drive the real engine through a reasoning end marker.

Its layers add nothing to the residual stream (o_proj and down_proj are zero), so the logits
at a position depend on that position's token alone: a bigram table. Each token of the chain
"\\n" -> "hello" -> " world" -> "</" -> "think" -> ">" -> "hello" ... gets its own embedding
direction, and lm_head maps it, strongly, to the next one. Every other token (JSON's, say)
has a random embedding away from those directions, so under a grammar the choice among the
allowed tokens is arbitrary but fixed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHAIN = ["\n", "hello", " world", "</", "think", ">"]
"""Each text is one token of the default tokenizer; the successor of the last is "hello"."""
REASONING = "hello world"
"""What the model writes before each "</think>"."""
GRANITE_CHAIN = ["\n", "Here", " is", " my", " thought", " process", ":", " hi", " Here", "'s", " m", "y", " response",
                 ":**", " ok"]
"""Granite's phrases as a chain of distinct tokens (" m", "y" spell the second " my"; ":**" the
second ":"): "Here is my thought process: hi Here's my response:** ok", then again."""


def chain_token_ids(tokenizer: Any, chain: list[str] = CHAIN) -> list[int]:
    ids = []
    for text in chain:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        assert len(encoded) == 1, (text, encoded)
        ids.append(encoded[0])
    return ids


def save_think_model(path: Path, tokenizer: Any, chain: list[str] = CHAIN) -> None:
    """The model above over ``chain`` (each a token of ``tokenizer``; the successor of the last
    is chain[1]), saved with the tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    chain = chain_token_ids(tokenizer, chain)
    width = len(chain)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight  # [V, 64]
        embed.normal_(0.0, 1.0)
        embed[:, :width] = 0.0  # the chain's directions belong to the chain alone
        lm_head = model.lm_head.weight  # [V, 64]
        lm_head.normal_(0.0, 0.02)
        for i, token_id in enumerate(chain):
            embed[token_id] = 0.0
            embed[token_id, i] = 1.0
            successor = chain[i + 1] if i + 1 < width else chain[1]
            lm_head[successor, i] = 2.0
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
