"""Pearson's chi-square goodness-of-fit test (no scipy: the survival function of the
chi-square distribution is the regularised upper incomplete gamma, in torch)."""

from __future__ import annotations

import torch

SIGNIFICANCE = 1e-3


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """counts: [V] observed; probs: [V] expected distribution. Cells with zero expected
    probability must have zero counts (else the fit is rejected outright: p = 0)."""
    counts = counts.double()
    probs = probs.double()
    zero = probs <= 0
    if counts[zero].sum() > 0:
        return 0.0
    n = counts.sum()
    expected = probs[~zero] * n
    stat = ((counts[~zero] - expected) ** 2 / expected).sum()
    df = int((~zero).sum()) - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2.0))
