"""SpeculativeConfig: speculative decoding's settings (vLLM's dict), one of EngineConfig's
parts; re-exported by config.py. No torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["SpecMethod", "SpeculativeConfig"]

SpecMethod = Literal["ngram", "draft_model"]
_SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
              "model", "draft_layers", "disable_by_batch_size", "min_acceptance_rate")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts tokens, the target verifies them in one pass."""

    method: SpecMethod
    """"ngram" (prompt lookup) or "draft_model" (a smaller model, or the target's first layers)."""
    num_speculative_tokens: int
    """Drafts proposed per request and step (k): a step verifies up to k + 1 tokens."""
    prompt_lookup_min: int = 2
    """ngram: shortest suffix n-gram that may match."""
    prompt_lookup_max: int = 5
    """ngram: longest suffix n-gram tried first."""
    model: str | None = None
    """draft_model: the draft checkpoint (same tokenizer as the target)."""
    draft_layers: int | None = None
    """draft_model without ``model``: self-speculation with the target's first L layers, its
    final norm and LM head (no second checkpoint)."""
    disable_by_batch_size: int | None = None
    """A step that runs at least this many requests proposes no drafts for the next (vLLM's
    key); None: never (spec_decode/policy.py)."""
    min_acceptance_rate: float | None = None
    """A request whose recent drafts were accepted at a lower rate gets none for a while (a
    doubling backoff); None: every request is drafted for (spec_decode/policy.py)."""

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(
                f"speculative_config method={self.method!r} is not one of 'ngram', 'draft_model'"
            )
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(
                f"speculative_config num_speculative_tokens={self.num_speculative_tokens!r} "
                "must be an integer >= 1"
            )
        if self.disable_by_batch_size is not None and (
            not isinstance(self.disable_by_batch_size, int) or self.disable_by_batch_size < 1
        ):
            raise ValueError(
                f"speculative_config disable_by_batch_size={self.disable_by_batch_size!r} must be an integer >= 1"
            )
        if self.min_acceptance_rate is not None and not 0 <= self.min_acceptance_rate <= 1:
            raise ValueError(
                f"speculative_config min_acceptance_rate={self.min_acceptance_rate!r} must be in [0, 1]"
            )
        if self.method == "ngram":
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise ValueError(
                    f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                    f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
                )
            if self.model is not None or self.draft_layers is not None:
                raise ValueError("speculative_config: 'model' and 'draft_layers' need method='draft_model'")
        else:
            if (self.model is None) == (self.draft_layers is None):
                raise ValueError(
                    "speculative_config method='draft_model' needs exactly one of 'model' (a draft "
                    "checkpoint) or 'draft_layers' (self-speculation with the target's first layers)"
                )
            if self.draft_layers is not None and self.draft_layers < 1:
                raise ValueError(f"speculative_config draft_layers={self.draft_layers} must be >= 1")

    @classmethod
    def from_dict(cls, config: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """The vLLM-style dict (``--speculative-config`` JSON, ``LLM(speculative_config=...)``)."""
        if config is None or isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
        unknown = sorted(set(config) - set(_SPEC_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {list(_SPEC_KEYS)}")
        for key in ("method", "num_speculative_tokens"):
            if key not in config:
                raise ValueError(f"speculative_config needs {key!r}")
        return cls(**config)

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past the verified tokens a draft model writes while proposing."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0
