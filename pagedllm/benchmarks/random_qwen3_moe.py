"""Write a Qwen3-MoE HF checkpoint of random weights in Qwen3-30B-A3B's shape, with fewer
layers, for `pagedllm bench latency|throughput --model DIR` (and llama.cpp's converter).

    python -m pagedllm.benchmarks.random_qwen3_moe OUT_DIR --num-layers 8 [--tokenizer DIR]

Qwen3-30B-A3B's config (Qwen/Qwen3-30B-A3B config.json): hidden 2048, 48 layers, 32 query
heads and 4 KV heads of head_dim 128, 128 experts of moe_intermediate 768, top-8,
renormalised, every layer sparse, vocabulary 151936, rope theta 1e6, RMSNorm eps 1e-6,
untied head. One layer holds 128 * 3 * 2048 * 768 = 604M expert weights (1.2 GB in bf16):
8 layers come to ~10 GB. Tensors are written one layer per safetensors file (with the
index), so memory stays at one layer. Weights N(0, 0.02), norms 1.

Tokenizer: `--tokenizer DIR` copies a real one (Qwen3's: llama.cpp's converter recognises
only known pre-tokenizers); without it a word-level tokenizer of the whole vocabulary
("<t0>" ... "<t151935>") is written, enough for pagedllm's random-token benchmarks.
Not a benchmark itself (not in BENCHMARKS).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Any

QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}


def _layer_tensors(cfg: dict[str, Any], i: int, gen: Any) -> dict[str, Any]:
    import torch

    h, d = cfg["hidden_size"], cfg["head_dim"]
    nq, nkv, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["moe_intermediate_size"]

    def rand(*shape: int) -> torch.Tensor:
        return (0.02 * torch.randn(*shape, generator=gen)).to(torch.bfloat16)

    p = f"model.layers.{i}"
    out = {
        f"{p}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        f"{p}.self_attn.q_proj.weight": rand(nq * d, h),
        f"{p}.self_attn.k_proj.weight": rand(nkv * d, h),
        f"{p}.self_attn.v_proj.weight": rand(nkv * d, h),
        f"{p}.self_attn.o_proj.weight": rand(h, nq * d),
        f"{p}.self_attn.q_norm.weight": torch.ones(d, dtype=torch.bfloat16),
        f"{p}.self_attn.k_norm.weight": torch.ones(d, dtype=torch.bfloat16),
        f"{p}.mlp.gate.weight": rand(cfg["num_experts"], h),
    }
    for e in range(cfg["num_experts"]):
        out[f"{p}.mlp.experts.{e}.gate_proj.weight"] = rand(inter, h)
        out[f"{p}.mlp.experts.{e}.up_proj.weight"] = rand(inter, h)
        out[f"{p}.mlp.experts.{e}.down_proj.weight"] = rand(h, inter)
    return out


def _word_level_tokenizer(out_dir: str, vocab_size: int, bos: int, eos: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=f"<t{bos}>", eos_token=f"<t{eos}>", unk_token="<t0>"
    )
    fast.save_pretrained(out_dir)


def write_checkpoint(
    out_dir: str,
    num_layers: int,
    tokenizer: str | None = None,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
) -> None:
    """overrides: config values replacing Qwen3-30B-A3B's (a shrunk copy for tests)."""
    import torch
    from safetensors.torch import save_file

    cfg = dict(QWEN3_30B_A3B, num_hidden_layers=num_layers, max_window_layers=num_layers, **(overrides or {}))
    os.makedirs(out_dir, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    shards: list[tuple[str, Any]] = [
        ("model-embed.safetensors", lambda: {
            "model.embed_tokens.weight": (0.02 * torch.randn(vocab, h, generator=gen)).to(torch.bfloat16),
            "lm_head.weight": (0.02 * torch.randn(vocab, h, generator=gen)).to(torch.bfloat16),
            "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        }),
        *((f"model-layer{i:03d}.safetensors", lambda i=i: _layer_tensors(cfg, i, gen)) for i in range(num_layers)),
    ]  # fmt: skip
    for name, build in shards:
        tensors = build()
        save_file(tensors, os.path.join(out_dir, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        print(f"wrote {name} ({len(tensors)} tensors)", flush=True)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    if tokenizer is None:
        _word_level_tokenizer(out_dir, vocab, cfg["bos_token_id"], cfg["eos_token_id"])
    else:
        for fname in os.listdir(tokenizer):
            if fname.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
                shutil.copy(os.path.join(tokenizer, fname), out_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--num-layers", type=int, default=8, help="of Qwen3-30B-A3B's 48")
    parser.add_argument("--tokenizer", default=None, help="a directory with a (Qwen3) tokenizer to copy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_checkpoint(args.out_dir, args.num_layers, args.tokenizer, args.seed)


if __name__ == "__main__":
    main()
