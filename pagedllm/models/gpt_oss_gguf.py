"""llama.cpp's `gpt-oss` GGUF files (models/gpt_oss.py's GGUFSpec): the block tensor names its
converter writes, and the GptOssConfig built from the file's `gpt-oss.*` keys."""

from __future__ import annotations

from typing import Any

# llama.cpp's gpt-oss block tensors -> HF's names where the converter kept HF's tensor (the
# sinks get a `.weight`, dropped by gpt_oss_tensors), this package's per-expert names where it
# split HF's 3-D expert stacks (gate_up_proj into gate and up, biases too).
GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.{expert}.gate_proj",
    "ffn_up_exps": "mlp.experts.{expert}.up_proj",
    "ffn_down_exps": "mlp.experts.{expert}.down_proj",
}


def gpt_oss_metadata_from_gguf(reader: Any, out_dir: str) -> tuple[Any, None]:
    """A `gpt-oss` GGUF's GptOssConfig from its keys (llama.cpp's converter writes them from
    the HF config: sliding window, YaRN's factor / original context / betas, experts, head
    size); None for the tokenizer: transformers' GGUF tokenizer builder reads this file's
    (byte-level BPE, the `gpt-4o` split, control tokens special, chat template). transformers'
    own config reader cannot: it reads each `gpt-oss.rope.scaling.*` value from the field's
    first part (the key's length) and fails."""
    from transformers import GptOssConfig

    def value(key: str, default: Any = None) -> Any:
        field = reader.fields.get(f"gpt-oss.{key}") or reader.fields.get(key)
        return default if field is None else field.contents()

    def required(key: str) -> Any:
        v = value(key)
        if v is None:
            raise ValueError(f"the gpt-oss GGUF has no gpt-oss.{key}")
        return v

    layers, window = int(required("block_count")), value("attention.sliding_window")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(value("rope.freq_base", 150000.0))}
    scaling = value("rope.scaling.type")
    if scaling not in (None, "none", "yarn"):
        raise ValueError(f"gpt-oss.rope.scaling.type {scaling!r} is not supported; supported: yarn, none")
    if scaling == "yarn":
        # truncate False: gpt-oss's YaRN keeps the correction range unrounded (its HF config's).
        rope.update(rope_type="yarn", factor=float(required("rope.scaling.factor")),
                    original_max_position_embeddings=int(required("rope.scaling.original_context_length")),
                    beta_fast=float(value("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(value("rope.scaling.yarn_beta_slow", 1.0)), truncate=False)  # fmt: skip
        if (attention_factor := value("rope.scaling.yarn_attn_factor")) is not None:
            rope["attention_factor"] = float(attention_factor)
    tokens = value("tokenizer.ggml.tokens")
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab = len(tokens) if tokens else int(embd.shape[-1]) if embd is not None else int(required("vocab_size"))

    def token_id(name: str) -> int | None:
        v = value(f"tokenizer.ggml.{name}_token_id")
        return None if v is None else int(v)

    heads = int(required("attention.head_count"))
    hidden = int(required("embedding_length"))
    config = GptOssConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(value("expert_feed_forward_length") or required("feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(value("attention.head_count_kv", heads)),
        head_dim=int(value("attention.key_length", hidden // heads)),
        num_local_experts=int(required("expert_count")),
        num_experts_per_tok=int(required("expert_used_count")),
        max_position_embeddings=int(required("context_length")),
        rms_norm_eps=float(value("attention.layer_norm_rms_epsilon", 1e-5)),
        sliding_window=int(window) if window else None,
        # llama.cpp's gpt-oss: even layers slide, odd ones attend fully (HF's alternation).
        layer_types=["sliding_attention" if window and i % 2 == 0 else "full_attention" for i in range(layers)],
        rope_parameters=rope,
        bos_token_id=token_id("bos"),
        eos_token_id=token_id("eos"),
        pad_token_id=token_id("padding"),
        architectures=["GptOssForCausalLM"],
    )
    return config, None
