"""Llama (and the Llama-shaped Mistral and Qwen2) over a flat batch of tokens.

Forward-only: `forward(input_ids, positions)` -> hidden states of every token,
`compute_logits(hidden_states)` at the positions that sample. Parameter names are HF's except
the fused projections (`qkv_proj` from q/k/v_proj, `gate_up_proj` from gate/up_proj), which
`load_weights` fills through the layers' weight loaders (models/utils.py).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import Attention
from pagedllm.layers.embedding import LMHead, VocabEmbedding
from pagedllm.layers.linear import MergedLinear, QKVLinear, RowParallelLinear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, get_rope
from pagedllm.layers.utils import default_dtype
from pagedllm.models.config_utils import head_dim_of, num_kv_heads_of, sliding_window_of
from pagedllm.models.fused_decode import FusedDecoderLayers
from pagedllm.models.utils import load_named_weights


# (fused parameter, checkpoint projection, shard id)
_STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
# Checkpoint entries that are not parameters here (rotary caches of old checkpoints).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        num_heads, num_kv_heads = config.num_attention_heads, num_kv_heads_of(config)
        head_dim = head_dim_of(config)
        attention_bias = bool(getattr(config, "attention_bias", False))
        # Qwen2 has biases on q/k/v but not on o_proj.
        qkv_bias = attention_bias or config.model_type == "qwen2"
        self.qkv_proj = QKVLinear(config.hidden_size, head_dim, num_heads, num_kv_heads, qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, config.hidden_size, bias=attention_bias)
        self.rotary_emb = rotary_emb
        self.attn = Attention(  # this rank's heads (all of them without tensor parallelism)
            self.qkv_proj.num_heads,
            head_dim,
            self.qkv_proj.num_kv_heads,
            scale=head_dim**-0.5,
            sliding_window=sliding_window_of(config, layer_idx),
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: [T, hidden] -> [T, hidden]
        qkv = self.qkv_proj(hidden_states)  # [T, (H + 2 * Hkv) * D]
        q, k, v = self.qkv_proj.split(qkv)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (only 'silu')")
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter], bias=bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> gate_up: [T, 2 * intermediate] -> [T, hidden]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, rotary_emb)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each norm can fuse the add before it.
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        # One cos/sin cache shared by every layer.
        rotary_emb = get_rope(head_dim_of(config), config.max_position_embeddings, config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary_emb) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Decode steps of a few rows: every layer in one compiled call (models/fused_decode.py).
        self.fused_layers = FusedDecoderLayers()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] int64 -> [T, hidden]
        hidden_states = self.embed_tokens(input_ids)
        if self.fused_layers.applies(self.layers, hidden_states):
            hidden_states, residual = self.fused_layers(positions, hidden_states)
            hidden_states, _ = self.norm(hidden_states, residual)
            return hidden_states
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    supports_tensor_parallel = True
    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = hf_config
        with default_dtype(dtype):
            self.model = LlamaModel(hf_config)
            self.lm_head = LMHead(hf_config.vocab_size, hf_config.hidden_size)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [num_tokens] int64 -> hidden_states: [num_tokens, hidden]
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: [N, hidden] (only the sampled positions) -> logits: [N, vocab] float32
        return self.lm_head(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named checkpoint tensors; returns the parameter names that were filled.

        Raises ValueError if a parameter (or a shard of a fused one) got no tensor.
        """

        def transform(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
            if name.endswith(_IGNORED_SUFFIXES):
                return None
            if name == "lm_head.weight" and self.tie_word_embeddings:
                return None  # the tied head is the embedding, loaded under its own name
            return name, tensor

        return load_named_weights(self, weights, stacked=_STACKED_PARAMS, transform=transform)
