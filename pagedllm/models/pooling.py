"""Pooling: one vector per prompt from its tokens' hidden states (embedding models).

How a checkpoint pools is read from sentence-transformers' files beside it: `modules.json`
lists the modules (a `Pooling` one whose directory holds `config.json`, and a `Normalize` one
when the vectors are unit length); a `--pooler-config` overrides each field it sets. Without
those files a family's default stands (CLS for BERT, last token for decoders).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.attention import Attention
from pagedllm.pooling_params import PoolerConfig

# sentence-transformers' 1_Pooling/config.json: the older boolean keys, and the newer
# `pooling_mode` names (6.x).
_ST_BOOLEAN_MODES = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}
_ST_MODE_NAMES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}


def read_sentence_transformers_config(model_dir: str) -> PoolerConfig:
    """The pooling `model_dir`'s sentence-transformers files state (fields None where they
    say nothing; all None without a modules.json)."""
    path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(path):
        return PoolerConfig()
    with open(path) as f:
        modules = json.load(f)
    pooling_type: str | None = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            pooling_type = _st_pooling_type(os.path.join(model_dir, module.get("path", ""), "config.json"))
    return PoolerConfig(pooling_type, normalize)  # type: ignore[arg-type]


def _st_pooling_type(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        config = json.load(f)
    mode = config.get("pooling_mode")
    if mode is not None:
        names = [mode] if isinstance(mode, str) else list(mode)
        found = [_ST_MODE_NAMES.get(n) for n in names]
    else:
        found = [t for key, t in _ST_BOOLEAN_MODES.items() if config.get(key)]
        names = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
    if len(found) != 1 or found[0] is None:
        raise ValueError(
            f"{path}: pooling {', '.join(map(str, names)) or 'none'} is not supported; "
            "supported: one of cls, mean, lasttoken"
        )
    return found[0]


def pool(hidden: torch.Tensor, query_start_loc: list[int], pooling_type: str) -> torch.Tensor:
    """hidden: [T, H], the prompts one after another (prompt i is rows query_start_loc[i] to
    query_start_loc[i + 1]) -> [R, H] float32."""
    starts = query_start_loc[:-1]
    ends = query_start_loc[1:]
    if pooling_type == "CLS":
        return hidden[starts].float()
    if pooling_type == "LAST":
        return hidden[[e - 1 for e in ends]].float()
    assert pooling_type == "MEAN", pooling_type
    lengths = torch.tensor([e - s for s, e in zip(starts, ends)], device=hidden.device)
    segment = torch.repeat_interleave(torch.arange(len(starts), device=hidden.device), lengths)  # [T]
    sums = torch.zeros(len(starts), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, segment, hidden.float())
    return sums / lengths[:, None].float()


def normalize(vectors: torch.Tensor) -> torch.Tensor:
    """[R, H] -> each row divided by its L2 norm."""
    return F.normalize(vectors, p=2, dim=-1)


DECODER_DEFAULTS = PoolerConfig("LAST", True)
"""A causal LM's pooling as an embedder (Qwen3-Embedding's): its last token, normalized."""


def resolve_pooling(
    model: Any, family_runner: str, model_dir: str, runner: str, convert: str, override: PoolerConfig
) -> tuple[str, PoolerConfig | None]:
    """(the runner, the model's pooling: checkpoint defaults < sentence-transformers files <
    --pooler-config; None where the model cannot pool). ValueError for what cannot be run."""
    classifier = hasattr(model, "classify")
    if family_runner == "pooling":
        if runner == "generate":
            raise ValueError(f"runner='generate': {type(model).__name__} is a pooling model (embed/classify only)")
        resolved_runner = "pooling"
        defaults = model.pooler_defaults
    else:
        resolved_runner = "pooling" if runner == "pooling" or convert in ("embed", "classify") else "generate"
        defaults = DECODER_DEFAULTS
    if convert == "classify" and not classifier:
        raise ValueError(
            f"convert='classify': {type(model).__name__} has no classifier; give a *ForSequenceClassification "
            "checkpoint, or for a causal LM scored by two tokens' logits (Qwen3-Reranker) --hf-overrides' recipe "
            "(docs/pooling.md)"
        )
    pooler = override.over(read_sentence_transformers_config(model_dir).over(defaults))
    return resolved_runner, pooler


def is_bidirectional(model: nn.Module) -> bool:
    """Whether any attention layer sees every key of its prompt (attention/params.py causal)."""
    return any(isinstance(m, Attention) and not m.params.causal for m in model.modules())
