"""A Qwen3-30B-A3B-shaped qwen3moe GGUF with N layers and the tests' tiny tokenizer (vocab
262, so the head is small and the layers dominate a step): experts random valid blocks of any
kept type (gate/up TYPE_GU, down TYPE_DOWN; std 0.02; `random_blocks`), the rest Q8_0 of
N(0, 0.02) weights, the router N(0, 1). For `pagedllm bench moe-grouped --model` (not a test).

    PYTHONPATH=. python -m tests.models.moe_bench_gguf OUT.gguf N TYPE_GU TYPE_DOWN
"""
from __future__ import annotations

import sys
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gguf
import torch
from transformers import Qwen3MoeConfig

from tests.models.utils import random_blocks, save_tiny_gguf, save_tiny_tokenizer


def main(out: Path, layers: int, gu_type: str, down_type: str) -> None:
    cfg = Qwen3MoeConfig(vocab_size=262, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                         num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096,
                         rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
    g = torch.Generator().manual_seed(0)
    h, d, E, I = 2048, 128, 128, 768
    sd = {"model.embed_tokens.weight": 0.02 * torch.randn(262, h, generator=g), "model.norm.weight": torch.ones(h),
          "lm_head.weight": 0.02 * torch.randn(262, h, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}"
        sd.update({f"{p}.input_layernorm.weight": torch.ones(h), f"{p}.post_attention_layernorm.weight": torch.ones(h),
                   f"{p}.self_attn.q_proj.weight": 0.02 * torch.randn(32 * d, h, generator=g),
                   f"{p}.self_attn.k_proj.weight": 0.02 * torch.randn(4 * d, h, generator=g),
                   f"{p}.self_attn.v_proj.weight": 0.02 * torch.randn(4 * d, h, generator=g),
                   f"{p}.self_attn.o_proj.weight": 0.02 * torch.randn(h, 32 * d, generator=g),
                   f"{p}.self_attn.q_norm.weight": torch.ones(d), f"{p}.self_attn.k_norm.weight": torch.ones(d),
                   f"{p}.mlp.gate.weight": torch.randn(E, h, generator=g)})

    def extra(writer: Any) -> None:
        writer.add_expert_count(E)
        writer.add_expert_used_count(8)
        writer.add_expert_feed_forward_length(I)
        for i in range(layers):
            for name, t, rows, k in (("ffn_gate_exps", gu_type, I, h), ("ffn_up_exps", gu_type, I, h),
                                     ("ffn_down_exps", down_type, h, I)):
                data = random_blocks(t, E * rows, k, seed=zlib.crc32(f"{i}{name}".encode()), std=0.02).reshape(E, rows, -1)
                writer.add_tensor(f"blk.{i}.{name}.weight", data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType[t])

    out.parent.mkdir(parents=True, exist_ok=True)
    save_tiny_gguf(out, SimpleNamespace(config=cfg, state_dict=lambda: sd), save_tiny_tokenizer(out.parent / "tok"),
                   qtype="Q8_0", arch="qwen3moe", extra=extra)
    print("wrote", out, out.stat().st_size >> 20, "MiB")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
