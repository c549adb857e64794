"""A layer's attention features as one value, which every backend runs or refuses by name.

A feature is a field whose value differs from its default (``AttentionParams.features``);
a backend declares the features it runs (``AttentionBackend.runs``) and refuses the others
at start-up (``AttentionBackend.check``), so a new feature is one field here plus the
backends that run it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class AttentionParams:
    """What one Attention layer computes, from the model's configuration."""

    scale: float
    """Scores are q.k * scale."""
    sliding_window: int | None = None
    """A query at position p sees keys in (p - window, p]; None: every earlier key."""
    logit_soft_cap: float | None = None
    """Each score s (after scaling) becomes c * tanh(s / c); None: uncapped."""
    sinks: bool = False
    """A learned logit per head (the layer's ``sinks`` [H]) joins each softmax's denominator
    with no value row (gpt-oss): attention may put weight on nothing."""
    causal: bool = True
    """False: every query sees every key of its prompt (embedding models); only prompt-only
    steps (each request's first and only chunk) have that meaning."""
    head_bias: tuple[float, ...] | None = None
    """[H] a constant added to every score of head h (a toy feature: it cancels in the
    softmax, except against a sink's logit)."""

    def __post_init__(self) -> None:
        if self.logit_soft_cap is not None and self.logit_soft_cap <= 0:
            raise ValueError(f"logit_soft_cap={self.logit_soft_cap} must be > 0 or None")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1 or None")
        if not self.causal and self.sliding_window is not None:
            raise ValueError(f"causal=False with sliding_window={self.sliding_window}: a window is causal")

    def features(self) -> list[str]:
        """The names of the fields this layer sets away from their defaults (scale aside:
        every backend scales)."""
        return [
            f.name for f in fields(self)
            if f.name != "scale" and getattr(self, f.name) != f.default
        ]
