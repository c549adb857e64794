"""Pooling requests and pooling models, as plain data (vLLM's names): what one request asks a
pooling model for (`PoolingParams`) and how the model pools (`PoolerConfig`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Literal

PoolingTask = Literal["embed", "classify", "score", "encode"]
POOLING_TASKS: tuple[str, ...] = ("embed", "classify", "score", "encode")
PoolingType = Literal["CLS", "MEAN", "LAST"]
POOLING_TYPES: tuple[str, ...] = ("CLS", "MEAN", "LAST")


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model turns hidden states into one vector per prompt (`--pooler-config`)."""

    pooling_type: PoolingType | None = None
    """CLS: the first token; MEAN: the average over the prompt; LAST: the last token.
    None: the checkpoint's (sentence-transformers files), else the family's default."""
    normalize: bool | None = None
    """Embeddings divided by their L2 norm. None: as the checkpoint says (a Normalize module)."""

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type={self.pooling_type!r} is not supported; supported: {', '.join(POOLING_TYPES)}"
            )

    @classmethod
    def from_json(cls, value: str | dict[str, Any] | None) -> PoolerConfig:
        """`--pooler-config` as vLLM takes it: a JSON object of these fields."""
        if value is None:
            return cls()
        data = json.loads(value) if isinstance(value, str) else value
        if not isinstance(data, dict):
            raise ValueError(f"--pooler-config must be a JSON object, got {value!r}")
        unknown = sorted(set(data) - {"pooling_type", "normalize"})
        if unknown:
            raise ValueError(f"--pooler-config: unknown field(s) {', '.join(unknown)}; known: pooling_type, normalize")
        pooling_type = data.get("pooling_type")
        return cls(pooling_type.upper() if isinstance(pooling_type, str) else pooling_type, data.get("normalize"))

    def over(self, base: PoolerConfig) -> PoolerConfig:
        """This config's set fields over ``base``'s."""
        fields = {"pooling_type": self.pooling_type, "normalize": self.normalize}
        return replace(base, **{k: v for k, v in fields.items() if v is not None})


@dataclass(frozen=True)
class PoolingParams:
    """What one pooling request asks for (LLM.embed/classify/score/encode; the server's
    pooling routes)."""

    task: PoolingTask = "embed"
    """embed: one vector (normalized as the model says); classify/score: the classifier's
    outputs, after `activation`; encode: the pooled vector as the model gives it."""
    normalize: bool | None = None
    """embed: divide by the L2 norm; None: the model's PoolerConfig.normalize."""
    dimensions: int | None = None
    """embed: keep the first `dimensions` values (Matryoshka), then normalize again."""
    activation: bool = True
    """classify/score: softmax over the labels (sigmoid for a single label); False: raw logits."""

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task={self.task!r} is not one of {', '.join(POOLING_TASKS)}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions={self.dimensions} must be >= 1")
