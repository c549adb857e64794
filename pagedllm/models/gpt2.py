"""GPT-2 over a flat batch of tokens: learned positions, pre-LayerNorm blocks, GELU (tanh).

Parameter names are HF's. GPT-2 checkpoints store their projections as Conv1D weights,
[in_features, out_features]; the loader transposes them to our Linear's [out, in]. The fused
`c_attn` projection stays fused (one matmul), its output split into q, k, v.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from pagedllm.layers.activation import get_act_fn
from pagedllm.layers.attention import Attention
from pagedllm.layers.embedding import LearnedPositionEmbedding, LMHead, VocabEmbedding
from pagedllm.layers.linear import ColumnParallelLinear, QKVLinear, RowParallelLinear
from pagedllm.layers.norm import LayerNorm
from pagedllm.layers.utils import default_dtype
from pagedllm.models.family import ArchConfig, GGUFSpec, ModelFamily
from pagedllm.models.utils import load_named_weights

# Conv1D weights, stored [in, out] in checkpoints.
_CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Causal-mask buffers some checkpoints carry.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


class GPT2Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        hidden, num_heads = config.hidden_size, config.num_attention_heads
        head_dim = hidden // num_heads
        self.c_attn = QKVLinear(hidden, head_dim, num_heads, num_heads, bias=True)  # rows: [q | k | v]
        self.c_proj = RowParallelLinear(hidden, hidden, bias=True)
        scale = head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= layer_idx + 1
        self.attn = Attention(self.c_attn.num_heads, head_dim, self.c_attn.num_kv_heads, scale=scale)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: [T, hidden] -> qkv: [T, 3 * hidden] -> [T, hidden]
        q, k, v = self.c_attn.split(self.c_attn(hidden_states))
        return self.c_proj(self.attn(q, k, v))


class GPT2MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        inner = config.n_inner or 4 * config.hidden_size
        self.c_fc = ColumnParallelLinear(config.hidden_size, inner, bias=True)
        self.c_proj = RowParallelLinear(inner, config.hidden_size, bias=True)
        self.act = get_act_fn(config.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, inner] -> [T, hidden]
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = LayerNorm(config.hidden_size, eps)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = LayerNorm(config.hidden_size, eps)
        self.mlp = GPT2MLP(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states))
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class GPT2Model(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.wte = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.wpe = LearnedPositionEmbedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = LayerNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] int64 -> [T, hidden]
        hidden_states = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            hidden_states = block(hidden_states)
        return self.ln_f(hidden_states)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, arch: ArchConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        hf_config = arch.hf
        if getattr(hf_config, "add_cross_attention", False):
            raise ValueError("GPT-2 with cross-attention (add_cross_attention=True) is not supported")
        self.config = hf_config
        self.arch = arch
        with default_dtype(dtype):
            self.transformer = GPT2Model(hf_config)
            self.lm_head = LMHead(hf_config.vocab_size, hf_config.hidden_size)
        self.tie_word_embeddings = arch.tie_word_embeddings
        if self.tie_word_embeddings:
            self.lm_head.tie(self.transformer.wte)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [num_tokens] int64 -> hidden_states: [num_tokens, hidden]
        return self.transformer(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: [N, hidden] -> logits: [N, vocab] float32
        return self.lm_head(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def transform(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
            if name.endswith(_IGNORED_SUFFIXES):
                return None
            if name == "lm_head.weight" and self.tie_word_embeddings:
                return None  # the tied head is the embedding, loaded under its own name
            if not name.startswith(("transformer.", "lm_head.")):
                name = "transformer." + name  # GPT2Model checkpoints have no prefix
            if name.endswith(_CONV1D_WEIGHTS):
                tensor = tensor.t()  # Conv1D [in, out] -> Linear [out, in]
            return name, tensor

        return load_named_weights(self, weights, transform=transform)


def _gpt2_arch_config(hf: Any) -> ArchConfig:
    return ArchConfig(
        hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_attention_heads,
        head_dim=hf.hidden_size // hf.num_attention_heads,
        intermediate_size=hf.n_inner or 4 * hf.hidden_size,
        vocab_size=hf.vocab_size,
        max_position_embeddings=hf.max_position_embeddings,
        norm_eps=hf.layer_norm_epsilon,
        norm="layer",
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        activation=hf.activation_function,
        gated_mlp=False,
        rope=None,  # learned positions
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        hf=hf,
    )


def _gpt2_config_from_gguf(reader: Any, hf_config: Any) -> dict[str, Any]:
    """Sizes transformers' `gpt2` GGUF reader leaves at GPT2Config's defaults: the context
    (it sets `n_ctx`, which GPT2Config no longer reads; the position table's rows are the
    truth) and the MLP width (the converter writes 4 * n_embd whatever `n_inner` was)."""
    tensors = {t.name: t for t in reader.tensors}
    # gguf-py's shapes are ggml's, fastest dimension first: [hidden, rows].
    out: dict[str, Any] = {"n_positions": int(tensors["position_embd.weight"].shape[1])}
    inner = int(tensors["blk.0.ffn_up.weight"].shape[1])
    if inner != 4 * hf_config.hidden_size:
        out["n_inner"] = inner
    return out


# llama.cpp's `gpt2` tensors -> HF's GPT2LMHeadModel names.
_GPT2_GGUF_GLOBAL_NAMES = {
    "token_embd": "transformer.wte",
    "position_embd": "transformer.wpe",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",  # absent when tied, as in OpenAI's checkpoints
}
_GPT2_GGUF_BLOCK_NAMES = {
    "attn_norm": "ln_1",
    "attn_qkv": "attn.c_attn",
    "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}

# The fused c_attn stays fused in checkpoints too: no packed modules.
FAMILIES = (
    ModelFamily(
        name="GPT-2",
        architectures=("GPT2LMHeadModel",),
        model_class=GPT2LMHeadModel,
        arch_config=_gpt2_arch_config,
        # The file holds the Conv1D weights as [out, in] (the converter transposed them):
        # handed over as HF's [in, out] so load_weights' transpose restores the file's rows.
        gguf=GGUFSpec(
            "gpt2",
            _GPT2_GGUF_BLOCK_NAMES,
            global_names=_GPT2_GGUF_GLOBAL_NAMES,
            block_prefix="transformer.h",
            hf_transposed=("attn_qkv", "attn_output", "ffn_up", "ffn_down"),
            config_from_gguf=_gpt2_config_from_gguf,
        ),
        supports_tensor_parallel=True,
    ),
)
