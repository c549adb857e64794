"""OPT over a flat batch of tokens: learned positions (offset 2), LayerNorm, ReLU.

Both block layouts: pre-norm (`do_layer_norm_before=True`, most sizes) and post-norm (OPT-350m,
which also projects embeddings in and out when `word_embed_proj_dim != hidden_size`).
Parameter names are HF's, except q/k/v_proj which load into the fused `qkv_proj`.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from pagedllm.layers.activation import get_act_fn
from pagedllm.layers.attention import Attention
from pagedllm.layers.embedding import LearnedPositionEmbedding, LMHead, VocabEmbedding
from pagedllm.layers.linear import ColumnParallelLinear, Linear, QKVLinear, RowParallelLinear
from pagedllm.layers.norm import LayerNorm
from pagedllm.layers.utils import default_dtype
from pagedllm.models.family import ArchConfig, ModelFamily
from pagedllm.models.utils import load_named_weights

PACKED_MODULES = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
)
# OPT reserves two leading rows of its position table (a fairseq padding convention).
_POSITION_OFFSET = 2


class OPTAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, num_heads = config.hidden_size, config.num_attention_heads
        head_dim = hidden // num_heads
        bias = config.enable_bias
        self.qkv_proj = QKVLinear(hidden, head_dim, num_heads, num_heads, bias=bias)
        self.out_proj = RowParallelLinear(hidden, hidden, bias=bias)
        # HF scales q after its projection; scaling the scores is the same product.
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, self.qkv_proj.num_kv_heads, scale=head_dim**-0.5)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: [T, hidden] -> [T, hidden]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        return self.out_proj(self.attn(q, k, v))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, affine = config.hidden_size, config.layer_norm_elementwise_affine
        self.pre_norm = bool(config.do_layer_norm_before)
        self.self_attn = OPTAttention(config)
        self.self_attn_layer_norm = LayerNorm(hidden, elementwise_affine=affine)
        self.fc1 = ColumnParallelLinear(hidden, config.ffn_dim, bias=config.enable_bias)
        self.fc2 = RowParallelLinear(config.ffn_dim, hidden, bias=config.enable_bias)
        self.activation_fn = get_act_fn(config.activation_function)
        self.final_layer_norm = LayerNorm(hidden, elementwise_affine=affine)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Pre-norm: x + f(norm(x)). Post-norm: norm(x + f(x)).
        residual = hidden_states
        if self.pre_norm:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states = residual + self.self_attn(hidden_states)
        if not self.pre_norm:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        residual = hidden_states
        if self.pre_norm:
            hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = residual + self.fc2(self.activation_fn(self.fc1(hidden_states)))
        if not self.pre_norm:
            hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states


class OPTDecoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, embed_dim = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = VocabEmbedding(config.vocab_size, embed_dim)
        self.embed_positions = LearnedPositionEmbedding(
            config.max_position_embeddings, hidden, offset=_POSITION_OFFSET
        )
        self.project_in = Linear(embed_dim, hidden) if embed_dim != hidden else None
        self.project_out = Linear(hidden, embed_dim) if embed_dim != hidden else None
        self.final_layer_norm: LayerNorm | None = None
        if config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False):
            self.final_layer_norm = LayerNorm(
                hidden, elementwise_affine=config.layer_norm_elementwise_affine
            )
        self.layers = nn.ModuleList(OPTDecoderLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] int64 -> [T, word_embed_proj_dim]
        inputs_embeds = self.embed_tokens(input_ids)  # [T, word_embed_proj_dim]
        if self.project_in is not None:
            inputs_embeds = self.project_in(inputs_embeds)  # [T, hidden]
        hidden_states = inputs_embeds + self.embed_positions(positions)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        if self.final_layer_norm is not None:
            hidden_states = self.final_layer_norm(hidden_states)
        if self.project_out is not None:
            hidden_states = self.project_out(hidden_states)
        return hidden_states


class OPTModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.decoder(input_ids, positions)


class OPTForCausalLM(nn.Module):
    def __init__(self, arch: ArchConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        hf_config = arch.hf
        self.config = hf_config
        self.arch = arch
        with default_dtype(dtype):
            self.model = OPTModel(hf_config)
            self.lm_head = LMHead(hf_config.vocab_size, hf_config.word_embed_proj_dim)
        self.tie_word_embeddings = arch.tie_word_embeddings
        if self.tie_word_embeddings:
            self.lm_head.tie(self.model.decoder.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [num_tokens] int64 -> hidden_states: [num_tokens, embed_dim]
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: [N, word_embed_proj_dim] -> logits: [N, vocab] float32
        return self.lm_head(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def transform(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
            if name == "lm_head.weight" and self.tie_word_embeddings:
                return None  # the tied head is the embedding, loaded under its own name
            if name.startswith("decoder."):
                name = "model." + name  # OPTModel checkpoints have no "model." prefix
            return name, tensor

        return load_named_weights(self, weights, stacked=PACKED_MODULES, transform=transform)


def _opt_arch_config(hf: Any) -> ArchConfig:
    return ArchConfig(
        hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_attention_heads,
        head_dim=hf.hidden_size // hf.num_attention_heads,
        intermediate_size=hf.ffn_dim,
        vocab_size=hf.vocab_size,
        max_position_embeddings=hf.max_position_embeddings,
        norm_eps=1e-5,  # torch's LayerNorm default, as HF's OPT
        norm="layer",
        norm_placement="pre" if hf.do_layer_norm_before else "post",
        qkv_bias=hf.enable_bias,
        o_bias=hf.enable_bias,
        mlp_bias=hf.enable_bias,
        activation=hf.activation_function,
        gated_mlp=False,
        rope=None,  # learned positions
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        hf=hf,
    )


FAMILIES = (
    ModelFamily(
        name="OPT",
        architectures=("OPTForCausalLM",),
        model_class=OPTForCausalLM,
        arch_config=_opt_arch_config,
        packed_modules=PACKED_MODULES,
        supports_tensor_parallel=True,
    ),
)
