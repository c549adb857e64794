"""vLLM's `--hf-overrides`, as far as it can be honoured: Qwen3-Reranker's recipe, which serves a
causal LM scored by the logits of two tokens as a one-label classifier.

    --hf-overrides '{"architectures": ["Qwen3ForSequenceClassification"],
                     "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'

At load the checkpoint's `*ForCausalLM` becomes the named `*ForSequenceClassification` of its
family with one label, whose `score` row is the LM head's row of the second token minus that of
the first (logit_yes - logit_no), so its sigmoid is softmax([logit_no, logit_yes])[yes], the
reranker's own score. Any other override is refused (a config pagedllm would not apply).
"""

from __future__ import annotations

from typing import Any

_KEYS = ("architectures", "classifier_from_token", "is_original_qwen3_reranker", "method")
# A causal LM family -> its sequence classifier (models/decoder_pooling.py).
_CLASSIFIER_OF = {
    "Qwen3ForCausalLM": "Qwen3ForSequenceClassification",
    "Qwen2ForCausalLM": "Qwen2ForSequenceClassification",
    "LlamaForCausalLM": "LlamaForSequenceClassification",
}
_SUPPORTED = (
    "supported: Qwen3-Reranker's recipe, {\"architectures\": [\"Qwen3ForSequenceClassification\"], "
    "\"classifier_from_token\": [\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}"
)


def check_hf_overrides(overrides: dict[str, Any] | None) -> None:
    """ValueError unless `overrides` is None or the two-token reranker recipe."""
    if overrides is None:
        return
    unknown = sorted(set(overrides) - set(_KEYS))
    if unknown:
        raise ValueError(f"hf_overrides {', '.join(unknown)} cannot be applied; {_SUPPORTED}")
    archs = overrides.get("architectures")
    tokens = overrides.get("classifier_from_token")
    two_way = overrides.get("is_original_qwen3_reranker") is True or overrides.get("method") == "from_2_way_softmax"
    if (
        not isinstance(archs, list) or len(archs) != 1 or archs[0] not in _CLASSIFIER_OF.values()
        or not isinstance(tokens, list) or len(tokens) != 2 or not all(isinstance(t, str) for t in tokens)
        or not two_way
    ):
        raise ValueError(f"hf_overrides {overrides!r} cannot be applied; {_SUPPORTED}")


def apply_hf_overrides(hf_config: Any, tokenizer: Any, overrides: dict[str, Any] | None) -> Any:
    """The config with the reranker recipe applied (`classifier_token_ids`: the two tokens'
    ids, read by the classifier's load_weights); ValueError for a checkpoint it does not fit."""
    if overrides is None:
        return hf_config
    from pagedllm.models.config_utils import architecture_of

    check_hf_overrides(overrides)
    source, target = architecture_of(hf_config), overrides["architectures"][0]
    if _CLASSIFIER_OF.get(source) != target:
        raise ValueError(
            f"hf_overrides architectures {[target]}: the checkpoint is a {source}; the conversion takes "
            f"{next((k for k, v in _CLASSIFIER_OF.items() if v == target), '?')}"
        )
    ids = []
    for token in overrides["classifier_from_token"]:
        encoded = tokenizer.encode(token, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"hf_overrides classifier_from_token {token!r} is {len(encoded)} tokens, not one")
        ids.append(int(encoded[0]))
    hf_config.architectures = [target]
    hf_config.num_labels = 1
    hf_config.classifier_token_ids = ids
    return hf_config
