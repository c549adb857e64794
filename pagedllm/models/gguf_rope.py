"""Llama 3 rope scaling back from a GGUF file's `rope_freqs.weight`.

llama.cpp's converter writes no rope-scaling metadata for `rope_type: llama3`: it stores the
per-pair divisors of the frequencies instead (rope_freqs [head_dim // 2], 1 for the fast pairs,
`factor` for the slow ones, a blend between), and transformers' GGUF reader ignores the tensor.
Without it a Llama-3.1/3.2 file would run with plain rope. The divisors are a function of
(factor, original_len / low_freq_factor, original_len / high_freq_factor), so the llama3
parameters are recovered from them, with original_max_position_embeddings chosen as 8192
(only the two wavelength bounds matter), and checked to reproduce the tensor.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

_ORIGINAL_LEN = 8192.0


def llama3_rope_from_freq_factors(
    freq_factors: np.ndarray, rope_theta: float, head_dim: int
) -> dict[str, Any] | None:
    """freq_factors: [head_dim // 2], llama.cpp's divisors of inv_freq. The llama3 rope
    parameters (rotary's form, with rope_theta) that give them, None if all are 1; ValueError
    if no llama3 setting reproduces them."""
    from pagedllm.layers.rotary import llama3_inv_freq

    rf = np.asarray(freq_factors, dtype=np.float64).reshape(-1)
    if np.allclose(rf, 1.0):
        return None
    inv_freq = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if rf.shape != inv_freq.shape:
        raise ValueError(f"rope_freqs has {rf.size} values, head_dim {head_dim} needs {inv_freq.size}")
    factor = float(rf.max())
    inv_wavelen = inv_freq / (2 * math.pi)  # falls with the pair index
    # smooth = (1/rf - 1/factor) / (1 - 1/factor) is linear in 1/wavelength between the bounds:
    # 1 at 1/high_wavelen, 0 at 1/low_wavelen.
    tol = 1e-6 * factor
    band = (rf > 1 + tol) & (rf < factor - tol)
    if band.sum() >= 2:
        smooth = (1 / rf[band] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(inv_wavelen[band], smooth, 1)
        inv_high, inv_low = (1 - intercept) / slope, -intercept / slope
    else:
        # At most one pair in the band: place the bounds between the neighbouring pairs.
        fast = inv_wavelen[rf <= 1 + tol].min()
        slow = inv_wavelen[rf >= factor - tol].max()
        if band.any():
            x = float(inv_wavelen[band][0])
            s = (1 / float(rf[band][0]) - 1 / factor) / (1 - 1 / factor)
            inv_high = math.sqrt(fast * x)
            inv_low = x - s * (inv_high - x) / (1 - s)
        else:
            inv_high, inv_low = fast * (slow / fast) ** (1 / 3), fast * (slow / fast) ** (2 / 3)
    params = {
        "rope_type": "llama3",
        "rope_theta": float(rope_theta),
        "factor": factor,
        "low_freq_factor": float(_ORIGINAL_LEN * inv_low),
        "high_freq_factor": float(_ORIGINAL_LEN * inv_high),
        "original_max_position_embeddings": int(_ORIGINAL_LEN),
    }
    rebuilt = llama3_inv_freq(torch.from_numpy(inv_freq).float(), params).double().numpy()
    if not np.allclose(inv_freq / rebuilt, rf, rtol=1e-4):
        raise ValueError(f"rope_freqs {rf.tolist()} is not a llama3 rope scaling")
    return params
