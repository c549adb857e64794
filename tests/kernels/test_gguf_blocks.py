"""GGUFBlocks: the file's blocks kept as bytes, and the reference matmul over them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from pagedllm.kernels.gguf_blocks import GGUFBlocks, gguf_embedding_lookup, gguf_linear, row_bytes


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q5_1"])
def test_reference_linear_and_lookup_match_the_dequantized_matrix(type_name: str) -> None:
    w = np.random.default_rng(0).standard_normal((12, 64)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType[type_name])
    blocks = GGUFBlocks(torch.from_numpy(raw), type_name, 64)
    assert blocks.shape == (12, 64) and blocks.nbytes == 12 * row_bytes(type_name, 64)
    dense = blocks.dequantize()
    assert (dense - torch.from_numpy(w)).abs().max() < 0.5  # it is the same matrix, rounded
    x = torch.randn(5, 64)
    # Small M may round the activations to int16 per group of 32 (csrc/gguf_dot_avx512.h): at
    # most 1/65534 of the group's largest |x| per element, times |w|.
    amax = x.abs().view(5, 2, 32).amax(-1).repeat_interleave(32, 1)  # [5, 64]
    bound = 1e-5 * (x.abs() @ dense.abs().T) + (amax / 65534) @ dense.abs().T
    assert bool(((gguf_linear(x, blocks) - x @ dense.T).abs() <= 1.01 * bound + 1e-6).all())
    ids = torch.tensor([3, 0, 11])
    torch.testing.assert_close(gguf_embedding_lookup(ids, blocks, torch.float32), dense[ids])


def test_rows_of_the_wrong_width_are_refused() -> None:
    with pytest.raises(ValueError, match="whole number"):
        row_bytes("Q4_K", 100)
    with pytest.raises(ValueError, match="take 36 bytes"):
        GGUFBlocks(torch.zeros(2, 35, dtype=torch.uint8), "Q4_0", 64)
