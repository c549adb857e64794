"""Tiny gpt-oss GGUF files as llama.cpp ships them, written with gguf-py's writer (runs where no
llama.cpp tree is): `write_gpt_oss_gguf` writes an HF `GptOssForCausalLM` directory with the
keys, tensor names, tensor types and MXFP4 block layout of llama.cpp's converter
(convert_hf_to_gguf.py, `GptOssModel`), checked against the converter itself in
test_gpt_oss_gguf.py where PAGEDLLM_LLAMA_CPP_DIR names a tree. `harmony_tokenizer` is a
byte-level BPE shaped as gpt-oss's o200k harmony tokenizer (its split regex, harmony's special
tokens), small.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.models.utils import add_decoder_shape

# o200k's pre-tokenizer split (gpt-oss's tokenizer.json; llama.cpp's `gpt-4o` pre-tokenizer).
O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
HARMONY_SPECIAL = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                   "<|end|>", "<|message|>", "<|call|>"]  # fmt: skip
MERGES = [("Ġ", "t"), ("h", "e"), ("t", "h"), ("Ġt", "he"), ("1", "2")]
# A harmony-shaped template (gpt-oss's writes more: the system message's date, tools' TypeScript).
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def harmony_tokenizer(extra_tokens: tuple[str, ...] = (), template: str = HARMONY_TEMPLATE) -> Any:
    """Byte-level BPE (256 bytes, MERGES) split by o200k's regex, harmony's special tokens
    (<|startoftext|> BOS, <|return|> EOS, <|endoftext|> padding, as gpt-oss's), `extra_tokens`
    added as plain (non-special) tokens, and `template` as the chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["".join(m) for m in MERGES]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|startoftext|>", eos_token="<|return|>", pad_token="<|endoftext|>"
    )
    markers = [t for t in HARMONY_SPECIAL if t not in fast.all_special_tokens]
    fast.add_special_tokens({"additional_special_tokens": markers})
    if extra_tokens:
        fast.add_tokens(list(extra_tokens))
    fast.chat_template = template
    return fast


def gpt_oss_config(vocab_size: int, window: int = 8, **overrides: Any) -> Any:
    """tests/models/test_gpt_oss.py's tiny shape (layer 0 sliding, layer 1 full; YaRN as
    shipped) over `vocab_size` tokens."""
    from transformers import GptOssConfig

    fields = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=window, max_position_embeddings=256,
    )  # fmt: skip
    return GptOssConfig(**{**fields, **overrides})


_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, R, K] float -> OpenAI's (blocks [E, R, K / 32, 16] uint8: byte j holds elements 2j
    (low nibble) and 2j + 1, scales [E, R, K / 32] uint8 e8m0): per 32 elements an exponent so
    the largest fits 6, each element the nearest e2m1."""
    g = w.reshape(*w.shape[:-1], -1, 32)
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    codes = (g / torch.exp2(exp).unsqueeze(-1)).unsqueeze(-1).sub(_FP4).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exp + 127).to(torch.uint8)


def save_gpt_oss(path: Path, hf_model: Any, tokenizer: Any, mxfp4: bool) -> None:
    """`hf_model` saved at `path` with `tokenizer`; mxfp4: its experts as the released
    checkpoints hold them (`_blocks` / `_scales`, config.json's `quantization_config` saying
    mxfp4), and the HF model's own expert weights set to
    transformers' dequantization of those (so the HF model is the reference for either file)."""
    from safetensors.torch import load_file, save_file

    hf_model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    if not mxfp4:
        return
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    state = load_file(str(path / "model.safetensors"))
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = to_mxfp4(state.pop(name).transpose(1, 2))  # rows [out, in]
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        with torch.no_grad():
            hf_model.get_parameter(name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())  # as the released checkpoints say
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config, indent=2))


def _ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OpenAI's MXFP4 -> ggml's block_mxfp4 rows: per 32 elements the e8m0 byte, then 16 bytes
    whose byte j holds element j (low nibble) and element j + 16 (high nibble)."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    out = np.concatenate([scales[..., None], packed], axis=-1)  # [E, R, G, 17]
    return np.ascontiguousarray(out.reshape(*out.shape[:-2], -1)).astype(np.uint8)


_ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}


def _gguf_tensors(state: dict[str, torch.Tensor]) -> list[tuple[str, np.ndarray, str]]:
    """(GGUF name, data, type) as llama.cpp's GptOssModel converter names and lays them out."""
    out: list[tuple[str, np.ndarray, str]] = []
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}  # fmt: skip
    for name, t in state.items():
        if name in globals_:
            out.append((globals_[name], t.float().numpy(), "F32"))
            continue
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        blk = f"blk.{layer}"
        module, _, kind = rest.rpartition(".")
        if rest == "input_layernorm.weight":
            out.append((f"{blk}.attn_norm.weight", t.float().numpy(), "F32"))
        elif rest == "post_attention_layernorm.weight":
            out.append((f"{blk}.post_attention_norm.weight", t.float().numpy(), "F32"))
        elif rest == "self_attn.sinks":
            out.append((f"{blk}.attn_sinks.weight", t.float().numpy(), "F32"))
        elif module.startswith("self_attn."):
            out.append((f"{blk}.{_ATTN[module.removeprefix('self_attn.')]}.{kind}", t.float().numpy(), "F32"))
        elif module == "mlp.router":
            out.append((f"{blk}.ffn_gate_inp.{kind}", t.float().numpy(), "F32"))
        elif rest == "mlp.experts.gate_up_proj":  # [E, H, 2I]: rows [E, 2I, H], gate even, up odd
            w = t.float().transpose(1, 2).numpy()
            out.append((f"{blk}.ffn_gate_exps.weight", np.ascontiguousarray(w[:, 0::2]), "F32"))
            out.append((f"{blk}.ffn_up_exps.weight", np.ascontiguousarray(w[:, 1::2]), "F32"))
        elif rest == "mlp.experts.gate_up_proj_bias":
            b = t.float().numpy()
            out.append((f"{blk}.ffn_gate_exps.bias", np.ascontiguousarray(b[:, 0::2]), "F32"))
            out.append((f"{blk}.ffn_up_exps.bias", np.ascontiguousarray(b[:, 1::2]), "F32"))
        elif rest == "mlp.experts.down_proj":  # [E, I, H] -> rows [E, H, I]
            out.append((f"{blk}.ffn_down_exps.weight", np.ascontiguousarray(t.float().transpose(1, 2).numpy()), "F32"))
        elif rest == "mlp.experts.down_proj_bias":
            out.append((f"{blk}.ffn_down_exps.bias", t.float().numpy(), "F32"))
        elif rest == "mlp.experts.gate_up_proj_blocks":
            blocks, scales = t.numpy(), state[name.replace("_blocks", "_scales")].numpy()
            out.append((f"{blk}.ffn_gate_exps.weight", _ggml_mxfp4(blocks[:, 0::2], scales[:, 0::2]), "MXFP4"))
            out.append((f"{blk}.ffn_up_exps.weight", _ggml_mxfp4(blocks[:, 1::2], scales[:, 1::2]), "MXFP4"))
        elif rest == "mlp.experts.down_proj_blocks":
            scales = state[name.replace("_blocks", "_scales")].numpy()
            out.append((f"{blk}.ffn_down_exps.weight", _ggml_mxfp4(t.numpy(), scales), "MXFP4"))
        elif not rest.endswith("_scales"):
            raise ValueError(f"no GGUF name for {name}")
    return out


def _add_vocab(writer: Any, tokenizer: Any, vocab_size: int) -> None:
    """The tokenizer as llama.cpp's `gpt2` vocabulary: the tokens by id (added special ones
    CONTROL, added plain ones USER_DEFINED), the merges, the special ids, the template."""
    import gguf

    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    added = tokenizer.added_tokens_decoder
    for token, token_id in tokenizer.get_vocab().items():
        tokens[token_id] = token
        if token_id in added:
            types[token_id] = gguf.TokenType.CONTROL if added[token_id].special else gguf.TokenType.USER_DEFINED
        else:
            types[token_id] = gguf.TokenType.NORMAL
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-4o")  # what llama.cpp's converter names gpt-oss's tokenizer
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(m) for m in MERGES])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)


def write_gpt_oss_gguf(src: Path, path: Path | str) -> None:
    """The HF gpt-oss directory `src` (float or MXFP4 experts, with its tokenizer) as llama.cpp's
    converter writes it with --outtype f32: its keys, names, F32 tensors, MXFP4 experts kept
    in ggml's block layout (the file type then MOSTLY_MXFP4_MOE, as the converter says)."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(str(src))
    tokenizer = AutoTokenizer.from_pretrained(str(src))
    state = load_file(str(src / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_type("model")
    add_decoder_shape(writer, cfg)
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("attention_factor") is not None:
            writer.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    mxfp4 = any(n.endswith("_blocks") for n in state)  # the converter's file type for such a checkpoint
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE if mxfp4 else gguf.LlamaFileType.ALL_F32)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_expert_feed_forward_length(cfg.intermediate_size)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_vocab(writer, tokenizer, cfg.vocab_size)
    for name, data, type_name in _gguf_tensors(state):
        if type_name == "MXFP4":
            writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def save_harmony_bigram(path: Path, tokenizer: Any, chain: list[str]) -> Path:
    """tests/reasoning/think_model.py's bigram model (greedy output fixed by the weights: each
    token of `chain` writes the next, the last chain[1]) as a gpt-oss checkpoint: the attention
    output and the experts' down projections (weights and biases) zero, so the residual stream
    is the embedding; MXFP4 experts, written as a gpt-oss GGUF at path / "model.gguf"."""
    from transformers import GptOssForCausalLM

    from tests.reasoning.think_model import chain_token_ids

    config = gpt_oss_config(len(tokenizer), max_position_embeddings=1024, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    model = GptOssForCausalLM(config).eval()
    ids = chain_token_ids(tokenizer, chain)
    width = len(ids)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.self_attn.o_proj.bias.zero_()
            layer.mlp.experts.down_proj.zero_()
            layer.mlp.experts.down_proj_bias.zero_()
        embed = model.model.embed_tokens.weight
        embed.normal_(0.0, 1.0)
        embed[:, :width] = 0.0
        lm_head = model.lm_head.weight
        lm_head.normal_(0.0, 0.02)
        for i, token_id in enumerate(ids):
            embed[token_id] = 0.0
            embed[token_id, i] = 1.0
            lm_head[ids[i + 1] if i + 1 < width else ids[1], i] = 2.0
    src = path / "hf"
    os.makedirs(src, exist_ok=True)
    save_gpt_oss(src, model, tokenizer, mxfp4=True)
    write_gpt_oss_gguf(src, path / "model.gguf")
    return path / "model.gguf"
