"""What a model family declares, in its own model file, for the rest of the package.

A model file ends with `FAMILIES = (ModelFamily(...), ...)`. The registry (models/registry.py)
finds those declarations by importing the package's modules the first time it is asked, so
adding a family is its model file (and its test) and no table elsewhere:
- the HF architecture names it loads (`architectures`) and its model class;
- `arch_config`: the HF config -> `ArchConfig`, the normalized facts model code and the fused
  decode read (biases, norms, activation, positions, windows, soft-capping, tying), so no
  shared code branches on `model_type`;
- `packed_modules`: the checkpoint projections loaded into one fused parameter;
- `gguf`: llama.cpp's architecture name, its tensor names and the converter's quirks;
- `supports_tensor_parallel`;
- `image`: how the family takes images (multimodal/spec.py), None for text only;
- `runner`: "pooling" for encoders that only embed or classify (BERT: models/bert.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

from torch import nn

from pagedllm.layers.moe import MoEConfig
from pagedllm.multimodal.spec import ImageSpec

NormKind = Literal["rms", "layer"]
# pre: norm before attention and MLP (Llama, GPT-2); post: after the residual add (OPT-350m);
# sandwich: before and after each of them (Gemma 3).
NormPlacement = Literal["pre", "post", "sandwich"]


@dataclass(frozen=True)
class ArchConfig:
    """A checkpoint's architecture, normalized across families (built by a family's
    `arch_config` from the HF config)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    """Per attention head; not always hidden_size / num_heads (Qwen3, Gemma 3, Mistral)."""
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    norm_eps: float
    norm: NormKind = "rms"
    norm_offset: float = 0.0
    """The norm scales by (norm_offset + weight): 1.0 for Gemma's RMSNorm."""
    norm_placement: NormPlacement = "pre"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    """An RMSNorm over each query and key head before the rotary embedding."""
    activation: str = "silu"
    """The MLP's activation, by its HF name."""
    gated_mlp: bool = True
    """act(x W_gate) * (x W_up), then W_down; else act(x W_fc), then W_proj."""
    rope: Mapping[str, Any] | None = None
    """Rotary settings as layers.rotary takes them ("rope_type", "rope_theta", ...); None for
    learned positions."""
    partial_rotary_factor: float = 1.0
    tie_word_embeddings: bool = False
    sliding_windows: tuple[int | None, ...] = ()
    """Per layer: its attention window, None for full attention (empty: all full)."""
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    moe: MoEConfig | None = None
    """Sparse mixture-of-experts MLPs (layers/moe.py): experts, top-k, which layers."""
    hf: Any = field(default=None, repr=False, compare=False)
    """The HF config, for settings only the family's own model file reads."""

    def sliding_window(self, layer_idx: int) -> int | None:
        return self.sliding_windows[layer_idx] if self.sliding_windows else None

    @property
    def model_sliding_window(self) -> int | None:
        """The window of the sliding-window layers, None when every layer attends fully."""
        windows = {w for w in self.sliding_windows if w is not None}
        assert len(windows) <= 1, windows
        return windows.pop() if windows else None


# The global (non-block) tensors of llama.cpp's files, the same in every architecture here.
GGUF_GLOBAL_NAMES: Mapping[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# llama.cpp's block tensor names -> HF's, for the Llama layer layout.
LLAMA_GGUF_BLOCK_NAMES: Mapping[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class GGUFSpec:
    """How llama.cpp's converter wrote a family's checkpoints."""

    architecture: str
    """general.architecture in the file, e.g. "llama"."""
    block_names: Mapping[str, str]
    """blk.N.<name> -> <block_prefix>.N.<HF name> (without .weight / .bias)."""
    optional_block_names: Mapping[str, str] = field(default_factory=dict)
    """Block tensors only some files of the architecture hold (Mixtral's experts in a `llama`
    file); a value with `{expert}` names a 3-D tensor split per expert at load."""
    permuted_qk: bool = False
    """Q/K rows interleaved per head for llama.cpp's rope kernel (undone at load)."""
    norm_plus_one: bool = False
    """RMSNorm scales stored as (1 + weight) where HF keeps the offset from one."""
    skipped_tensors: tuple[str, ...] = ()
    """Tensors that are not parameters here (e.g. precomputed rope factors)."""
    config_from_gguf: Callable[[Any, Any], Mapping[str, Any]] | None = None
    """(gguf-py's GGUFReader of the file, the HF config transformers built from it) -> HF
    config fields its GGUF reader leaves out or at their defaults (Phi-3's long rope and
    window, Gemma 2's soft-caps and attention scale), set on the config once, at conversion."""
    global_names: Mapping[str, str] = field(default_factory=lambda: dict(GGUF_GLOBAL_NAMES))
    block_prefix: str = "model.layers"
    """The HF name of the blocks' list ("transformer.h" in GPT-2)."""
    hf_transposed: tuple[str, ...] = ()
    """Block matrices HF checkpoints store transposed, [in, out] (GPT-2's Conv1D), where the
    file has llama.cpp's [out, in]: the reader hands them over in HF's layout (a kept one as
    gguf_quant.TransposedKept, whose .t() is the file's rows), so the family's own transpose
    of HF checkpoints applies unchanged."""
    metadata_from_gguf: Callable[[Any, str], tuple[Any, Any]] | None = None
    """(gguf-py's GGUFReader of the file, the metadata directory being written) -> (HF config,
    tokenizer), for architectures transformers' GGUF reader does not know (llama.cpp's `bert`)
    or misreads (`gpt-oss`); it may write further checkpoint files there (sentence-transformers'
    pooling modules). A tokenizer of None: transformers' GGUF tokenizer builder reads the file's."""


@dataclass(frozen=True)
class ModelFamily:
    """One family's declaration (see the module docstring)."""

    name: str
    architectures: tuple[str, ...]
    """HF `architectures` names, e.g. ("LlamaForCausalLM",)."""
    model_class: type[nn.Module]
    """Built as model_class(arch: ArchConfig, dtype)."""
    arch_config: Callable[[Any], ArchConfig]
    packed_modules: tuple[tuple[str, str, str | int], ...] = ()
    """(fused parameter, checkpoint projection, shard id), e.g. ("qkv_proj", "q_proj", "q")."""
    gguf: GGUFSpec | None = None
    supports_tensor_parallel: bool = False
    image: ImageSpec | None = None
    """Image inputs (multimodal/spec.py): the model has `encode_images` and `embed_input_ids`
    and takes `inputs_embeds`; None: text only."""
    runner: Literal["generate", "pooling"] = "generate"
    """pooling: an encoder that only embeds or classifies (models/pooling.py); its model has
    `pooler_defaults` and, for a classifier, `classify(pooled)`."""
