"""Gemma 3 (text only) over a flat batch of tokens.

What sets it apart from Llama: RMSNorm scaling by (1 + weight), embeddings multiplied by
sqrt(hidden_size), RMSNorm on each query and key head, norms after attention and after the
MLP as well as before them, a GELU(tanh)-gated MLP, attention scaled by
query_pre_attn_scalar**-0.5, and interleaved local (sliding-window) and global layers, each
kind with its own rotary base. Optional attention and final logit soft-capping (Gemma 2's;
Gemma 3's checkpoints leave them unset); tied embeddings.
Parameter names are HF's except the fused `qkv_proj` and `gate_up_proj`.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
from torch import nn

from pagedllm.layers.activation import GeluAndMul, gelu_approximation
from pagedllm.layers.attention import Attention
from pagedllm.layers.embedding import LMHead, VocabEmbedding
from pagedllm.layers.linear import Linear, MergedLinear, QKVLinear
from pagedllm.layers.norm import GemmaRMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, rope_parameters
from pagedllm.layers.utils import default_dtype
from pagedllm.models.config_utils import (
    decoder_sizes,
    head_dim_of,
    num_kv_heads_of,
    sliding_window_of,
    sliding_windows_of,
)
from pagedllm.models.family import LLAMA_GGUF_BLOCK_NAMES, ArchConfig, GGUFSpec, ModelFamily
from pagedllm.models.utils import load_named_weights

PACKED_MODULES = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def layer_rope_parameters(config: Any, sliding: bool) -> dict[str, Any]:
    """Rope settings of the local (sliding) or global layers.

    transformers 5 keys `rope_parameters` by layer type; older configs give the global
    settings flat and the local base as `rope_local_base_freq`.
    """
    params = getattr(config, "rope_parameters", None) or {}
    layer_type = "sliding_attention" if sliding else "full_attention"
    if layer_type in params:
        flat = dict(params[layer_type])
        flat.setdefault("rope_type", "default")
        return flat
    if sliding:
        return {"rope_type": "default", "rope_theta": config.rope_local_base_freq}
    return rope_parameters(config)


class Gemma3Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        num_heads, num_kv_heads = config.num_attention_heads, num_kv_heads_of(config)
        self.head_dim = head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVLinear(config.hidden_size, head_dim, num_heads, num_kv_heads, bias)
        self.o_proj = Linear(num_heads * head_dim, config.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            num_heads,
            head_dim,
            num_kv_heads,
            scale=config.query_pre_attn_scalar**-0.5,
            sliding_window=sliding_window_of(config, layer_idx),
            logit_soft_cap=getattr(config, "attn_logit_softcapping", None),
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: [T, hidden] -> [T, hidden]
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        # Norms per head: [T, H * D] -> [T, H, D] -> back.
        q = self.q_norm(q.view(num_tokens, -1, self.head_dim)).view(num_tokens, -1)
        k = self.k_norm(k.view(num_tokens, -1, self.head_dim)).view(num_tokens, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Gemma3MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter])
        self.down_proj = Linear(inter, config.hidden_size)
        self.act_fn = GeluAndMul(gelu_approximation(config.hidden_activation))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, 2 * intermediate] -> [T, hidden]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer_idx, rotary_emb)
        self.mlp = Gemma3MLP(config)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        attn_out = self.self_attn(positions, self.input_layernorm(hidden_states))
        hidden_states = hidden_states + self.post_attention_layernorm(attn_out)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(mlp_out)


class Gemma3Model(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        # sqrt(hidden) rounded to the model dtype first, as HF does.
        normalizer = torch.tensor(math.sqrt(config.hidden_size), dtype=torch.get_default_dtype())
        self.register_buffer("normalizer", normalizer, persistent=False)
        head_dim, max_pos = head_dim_of(config), config.max_position_embeddings
        # One cos/sin cache per layer kind, shared by the layers of that kind.
        local_rope = RotaryEmbedding(head_dim, max_pos, layer_rope_parameters(config, sliding=True))
        global_rope = RotaryEmbedding(head_dim, max_pos, layer_rope_parameters(config, sliding=False))
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(
                config, i, local_rope if sliding_window_of(config, i) is not None else global_rope
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] int64 -> [T, hidden]
        hidden_states = self.embed_tokens(input_ids) * self.normalizer
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states)
        return self.norm(hidden_states)


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, arch: ArchConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        hf_config = arch.hf
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention=True is not supported")
        self.config = hf_config
        self.arch = arch
        with default_dtype(dtype):
            self.model = Gemma3Model(hf_config)
            self.lm_head = LMHead(hf_config.vocab_size, hf_config.hidden_size)
        self.tie_word_embeddings = arch.tie_word_embeddings
        if self.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)
        self.final_logit_softcapping = arch.final_logit_softcap

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [num_tokens] int64 -> hidden_states: [num_tokens, hidden]
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: [N, hidden] -> logits: [N, vocab] float32
        logits = self.lm_head(hidden_states).float()
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap  # smoothly bounded to (-cap, cap)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def transform(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
            if name == "lm_head.weight" and self.tie_word_embeddings:
                return None  # the tied head is the embedding, loaded under its own name
            if name.startswith("language_model."):  # text weights of a multimodal checkpoint
                name = name.removeprefix("language_model.")
            return name, tensor

        return load_named_weights(self, weights, stacked=PACKED_MODULES, transform=transform)


def _gemma3_arch_config(hf: Any) -> ArchConfig:
    bias = bool(getattr(hf, "attention_bias", False))
    return ArchConfig(
        **decoder_sizes(hf),
        norm_eps=hf.rms_norm_eps,
        norm_offset=1.0,
        norm_placement="sandwich",
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        activation=hf.hidden_activation,
        rope=rope_parameters(hf),  # the global layers'; the local ones': layer_rope_parameters
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        sliding_windows=sliding_windows_of(hf),
        attn_logit_softcap=getattr(hf, "attn_logit_softcapping", None),
        final_logit_softcap=getattr(hf, "final_logit_softcapping", None),
        hf=hf,
    )


FAMILIES = (
    ModelFamily(
        name="Gemma 3",
        architectures=("Gemma3ForCausalLM",),
        model_class=Gemma3ForCausalLM,
        arch_config=_gemma3_arch_config,
        packed_modules=PACKED_MODULES,
        # Its norms sit around attention and MLP, it norms q and k, and llama.cpp's converter
        # stored its RMSNorm scales as (1 + weight).
        gguf=GGUFSpec(
            "gemma3",
            {
                **LLAMA_GGUF_BLOCK_NAMES,
                "ffn_norm": "pre_feedforward_layernorm",
                "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm",
                "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm",
            },
            norm_plus_one=True,
        ),
    ),
)
