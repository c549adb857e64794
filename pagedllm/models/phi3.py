"""Phi-3 (Phi3ForCausalLM): the Llama layer with fused checkpoint projections and LongRoPE.

Phi-3's differences from Llama, all stated here:
- the checkpoint holds q, k and v as one `self_attn.qkv_proj` ([q | k | v] rows) and gate and
  up as one `mlp.gate_up_proj` ([gate | up]): the very layouts of our fused QKVLinear and
  MergedLinear, so they load under their own names as whole tensors (shard id None), and
  tensor parallelism splits them per section (q, k, v; gate, up) before taking a rank's rows
  (layers/linear.py);
- the long-context variants' rope ("su" / "longrope": short and long factors and an attention
  factor, layers/longrope.py, with the rule for switching between them stated there);
- an optional `sliding_window` on every layer (Phi-3-mini-4k: 2047);
- a `partial_rotary_factor` (Phi-4-mini, also Phi3ForCausalLM: 0.75 of each head rotates),
  which the fused decode does not run (such a model decodes module by module);
- llama.cpp's "phi3" GGUF names (`attn_qkv`, `ffn_up` holding gate and up), no Q/K row
  permutation (its rope is NeoX-style, HF's layout), and the long rope's settings in the
  file's metadata plus its factors as tensors (`rope_factors_long` / `_short`), which
  transformers' GGUF reader does not map: `gguf_config_overrides` restores them.
Residual dropout is the identity at inference. The decoder layer is Llama's, fused decode
included for whole-head rotary: a decode's rotary row is its position (layers/longrope.py).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from pagedllm.models.family import ArchConfig, GGUFSpec, ModelFamily
from pagedllm.models.llama import LlamaForCausalLM, llama_arch_config
from pagedllm.models.utils import load_named_weights

_ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint names are ours (fused qkv_proj, gate_up_proj): no packed modules."""

        def transform(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
            if name == "lm_head.weight" and self.tie_word_embeddings:
                return None
            return name, tensor

        return load_named_weights(self, weights, transform=transform)


def _phi3_arch_config(hf: Any) -> ArchConfig:
    arch = llama_arch_config(hf)  # partial_rotary_factor from the rope settings (Phi-4-mini: 0.75)
    assert arch.rope is not None
    rope = dict(arch.rope)
    if rope["rope_type"] in ("su", "longrope"):
        rope["rope_type"] = "longrope"
        rope.setdefault("original_max_position_embeddings", hf.original_max_position_embeddings)
    return llama_arch_config(hf, rope=rope)


def gguf_config_overrides(reader: Any, hf_config: Any) -> dict[str, Any]:
    """HF config fields of a phi3 GGUF that transformers' GGUF reader leaves out (gguf-py's
    GGUFReader of the file -> {field: value}): llama.cpp's converter writes the long rope as
    `phi3.rope.scaling.original_context_length` and `.attn_factor` plus the factor tensors,
    and the window as `phi3.attention.sliding_window` (0: none)."""
    fields = reader.fields
    overrides: dict[str, Any] = {}
    window = fields.get("phi3.attention.sliding_window")
    if window is not None:
        overrides["sliding_window"] = int(window.contents()) or None
    factors = {t.name: [float(x) for x in t.data.reshape(-1)] for t in reader.tensors if t.name in _ROPE_FACTOR_TENSORS}
    if not factors:
        return overrides
    original = int(fields["phi3.rope.scaling.original_context_length"].contents())
    head_dim = int(fields["phi3.embedding_length"].contents()) // int(fields["phi3.attention.head_count"].contents())
    rotary_dim = fields.get("phi3.rope.dimension_count")
    rope: dict[str, Any] = {
        "rope_type": "longrope",
        "rope_theta": float(fields["phi3.rope.freq_base"].contents()),
        "partial_rotary_factor": 1.0 if rotary_dim is None else int(rotary_dim.contents()) / head_dim,
        "long_factor": factors["rope_factors_long.weight"],
        "short_factor": factors["rope_factors_short.weight"],
        "original_max_position_embeddings": original,
    }
    attn_factor = fields.get("phi3.rope.scaling.attn_factor")
    if attn_factor is not None:
        rope["attention_factor"] = float(attn_factor.contents())
    overrides.update(rope_parameters=rope, original_max_position_embeddings=original)
    return overrides


FAMILIES = (
    ModelFamily(
        name="Phi-3",
        architectures=("Phi3ForCausalLM",),
        model_class=Phi3ForCausalLM,
        arch_config=_phi3_arch_config,
        gguf=GGUFSpec(
            "phi3",
            {
                "attn_norm": "input_layernorm",
                "ffn_norm": "post_attention_layernorm",
                "attn_qkv": "self_attn.qkv_proj",
                "attn_output": "self_attn.o_proj",
                "ffn_up": "mlp.gate_up_proj",
                "ffn_down": "mlp.down_proj",
            },
            skipped_tensors=_ROPE_FACTOR_TENSORS,
            config_from_gguf=gguf_config_overrides,
        ),
        supports_tensor_parallel=True,
    ),
)
