"""The decoder families (Llama, Qwen2, Qwen3) as pooling models: their bare `*Model`
checkpoints (embedders such as gte-Qwen2 and Qwen3-Embedding saved by sentence-transformers:
no LM head, no "model." prefix) pooled at the last token and normalized unless their files say
otherwise; and their `*ForSequenceClassification`, the model with a `score` head
[num_labels, hidden] (no bias) in place of the LM head, read at each prompt's last token."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from pagedllm.layers.linear import Linear
from pagedllm.layers.utils import default_dtype
from pagedllm.models.family import ArchConfig, ModelFamily
from pagedllm.models.llama import PACKED_MODULES, LlamaModel, _qwen2_arch_config, llama_arch_config
from pagedllm.models.pooling import DECODER_DEFAULTS, PoolerConfig
from pagedllm.models.qwen3 import Qwen3Model
from pagedllm.models.utils import load_named_weights


class LlamaEmbeddingModel(nn.Module):
    """A bare decoder (HF's LlamaModel / Qwen2Model / Qwen3Model): forward -> hidden states."""

    inner_model: type[LlamaModel] = LlamaModel
    pooler_defaults = DECODER_DEFAULTS

    def __init__(self, arch: ArchConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = arch.hf
        self.arch = arch
        with default_dtype(dtype):
            self.model = self.inner_model(arch)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] int64 -> [T, hidden]
        return self.model(input_ids, positions)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def transform(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
            if name.endswith("rotary_emb.inv_freq") or name.startswith("lm_head."):
                return None
            return (name if name.startswith("model.") else "model." + name), tensor

        return load_named_weights(self, weights, stacked=PACKED_MODULES, transform=transform)


class Qwen3EmbeddingModel(LlamaEmbeddingModel):
    inner_model = Qwen3Model


class LlamaForSequenceClassification(nn.Module):
    inner_model: type[LlamaModel] = LlamaModel
    pooler_defaults = PoolerConfig("LAST", False)

    def __init__(self, arch: ArchConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = arch.hf
        self.arch = arch
        with default_dtype(dtype):
            self.model = self.inner_model(arch)
            self.score = Linear(arch.hidden_size, arch.hf.num_labels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] int64 -> [T, hidden]
        return self.model(input_ids, positions)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        # pooled: [R, hidden] (each prompt's last state) -> [R, num_labels] float32
        return self.score(pooled).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def transform(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
            return None if name.endswith("rotary_emb.inv_freq") else (name, tensor)

        token_ids = getattr(self.config, "classifier_token_ids", None)
        if token_ids is not None:  # a causal LM converted at load (models/hf_overrides.py)
            weights = _score_from_lm_head(weights, token_ids, bool(getattr(self.config, "tie_word_embeddings", False)))
        return load_named_weights(self, weights, stacked=PACKED_MODULES, transform=transform)


def _score_from_lm_head(
    weights: Iterable[tuple[str, Any]], token_ids: list[int], tied: bool
) -> Iterable[tuple[str, Any]]:
    """A causal LM's weights with its LM head (the embedding when tied and the checkpoint has
    no head) replaced by the one-label `score` row: head[second token] - head[first]
    (Qwen3-Reranker's logit_yes - logit_no)."""
    rows: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name == "lm_head.weight" or (tied and name == "model.embed_tokens.weight"):
            no, yes = token_ids
            if isinstance(tensor, torch.Tensor):
                pair = tensor[[no, yes]].float()
            elif hasattr(tensor, "rows"):  # kept quantized (GGUF blocks, int8/int4): the two rows dequantized
                pair = tensor.rows(torch.tensor([no, yes])).dequantize().float()
            else:
                raise ValueError(f"{name} ({type(tensor).__name__}) cannot be converted into the score row")
            rows[name] = (pair[1] - pair[0])[None]
        if name != "lm_head.weight":
            yield name, tensor
    row = rows.get("lm_head.weight", rows.get("model.embed_tokens.weight"))
    if row is None:
        raise ValueError("the checkpoint has no lm_head.weight to convert into the classifier's score row")
    yield "score.weight", row


class Qwen3ForSequenceClassification(LlamaForSequenceClassification):
    inner_model = Qwen3Model


def _qwen3_arch_config(hf: Any) -> ArchConfig:
    return llama_arch_config(hf, qk_norm=True)


FAMILIES = (
    ModelFamily("Llama embedder", ("LlamaModel",), LlamaEmbeddingModel, llama_arch_config, PACKED_MODULES,
                runner="pooling"),
    ModelFamily("Qwen2 embedder", ("Qwen2Model",), LlamaEmbeddingModel, _qwen2_arch_config, PACKED_MODULES,
                runner="pooling"),
    ModelFamily("Qwen3 embedder", ("Qwen3Model",), Qwen3EmbeddingModel, _qwen3_arch_config, PACKED_MODULES,
                runner="pooling"),
    ModelFamily(
        "Llama classifier", ("LlamaForSequenceClassification",), LlamaForSequenceClassification,
        llama_arch_config, PACKED_MODULES, runner="pooling",
    ),
    ModelFamily(
        "Qwen2 classifier", ("Qwen2ForSequenceClassification",), LlamaForSequenceClassification,
        _qwen2_arch_config, PACKED_MODULES, runner="pooling",
    ),
    ModelFamily(
        "Qwen3 classifier", ("Qwen3ForSequenceClassification",), Qwen3ForSequenceClassification,
        _qwen3_arch_config, PACKED_MODULES, runner="pooling",
    ),
)
