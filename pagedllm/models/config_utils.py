"""Reading model facts from HF configs uniformly across architectures (for the families'
`arch_config` builders and the loader; model code reads models/family.ArchConfig)."""

from __future__ import annotations

from typing import Any


def architecture_of(hf_config: Any) -> str:
    """The HF architecture name, e.g. "LlamaForCausalLM".

    Configs built from GGUF metadata carry no `architectures`; derive it from model_type.
    """
    architectures = getattr(hf_config, "architectures", None)
    if architectures:
        return architectures[0]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_config.model_type)
    if name is None:
        raise ValueError(f"no causal-LM architecture known for model_type={hf_config.model_type!r}")
    return name


def text_config_of(hf_config: Any) -> Any:
    """The language model's config: a vision-language config's `text_config`, else itself."""
    return getattr(hf_config, "text_config", None) or hf_config


def head_dim_of(hf_config: Any) -> int:
    head_dim = getattr(hf_config, "head_dim", None)
    return head_dim or hf_config.hidden_size // hf_config.num_attention_heads


def num_kv_heads_of(hf_config: Any) -> int:
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None)
    return num_kv_heads or hf_config.num_attention_heads


def sliding_window_of(hf_config: Any, layer_idx: int) -> int | None:
    """The layer's attention window, None for full attention.

    With `layer_types` (transformers 5) only "sliding_attention" layers use the window;
    without it (e.g. Mistral) every layer does when `sliding_window` is set.
    """
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if window is None or (layer_types and layer_types[layer_idx] != "sliding_attention"):
        return None
    return window


def sliding_windows_of(hf_config: Any) -> tuple[int | None, ...]:
    """Every layer's window (ArchConfig.sliding_windows)."""
    return tuple(sliding_window_of(hf_config, i) for i in range(hf_config.num_hidden_layers))



def decoder_sizes(hf_config: Any) -> dict[str, int]:
    """The ArchConfig size fields of a decoder config under HF's common names (Llama, Qwen,
    Gemma and the like; GPT-2 and OPT name them otherwise)."""
    return dict(
        hidden_size=hf_config.hidden_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=num_kv_heads_of(hf_config),
        head_dim=head_dim_of(hf_config),
        intermediate_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
    )
