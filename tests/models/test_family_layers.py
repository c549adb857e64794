"""Layers added for GPT-2, OPT and Gemma 3: LayerNorm, Gemma's RMSNorm, learned positions,
activations by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.activation import GeluAndMul, get_act_fn
from pagedllm.layers.embedding import LearnedPositionEmbedding
from pagedllm.layers.norm import GemmaRMSNorm, LayerNorm


def test_layer_norm_matches_torch() -> None:
    ref = torch.nn.LayerNorm(16, eps=1e-5)
    ref.weight.data, ref.bias.data = torch.randn(16), torch.randn(16)
    ours = LayerNorm(16, eps=1e-5)
    assert ours.weight is not None and ours.bias is not None
    ours.weight.data.copy_(ref.weight.data)
    ours.bias.data.copy_(ref.bias.data)
    x = torch.randn(5, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), atol=0, rtol=0)
    plain = LayerNorm(16, elementwise_affine=False)
    assert list(plain.parameters()) == []
    torch.testing.assert_close(plain(x), F.layer_norm(x, (16,)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_matches_hf(dtype: torch.dtype) -> None:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    ref = Gemma3RMSNorm(16, eps=1e-6)
    ref.weight.data = 0.1 * torch.randn(16)
    ours = GemmaRMSNorm(16, eps=1e-6)
    ours.weight.data.copy_(ref.weight.data)
    ref, ours = ref.to(dtype), ours.to(dtype)
    x = torch.randn(3, 4, 16).to(dtype)  # norms apply per head too: [T, H, D]
    # float32 runs the compiled kernel (the fused decode's), which sums the squares in another
    # order than torch's mean: within float32 rounding; bfloat16 runs HF's formulation exactly.
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), **tol)


def test_learned_positions_skip_the_offset_rows() -> None:
    emb = LearnedPositionEmbedding(8, 4, offset=2)
    emb.weight.weight_loader(emb.weight, torch.randn(10, 4))
    torch.testing.assert_close(emb(torch.tensor([0, 7])), emb.weight[[2, 9]])


def test_activations_by_name() -> None:
    x = torch.randn(3, 10)
    torch.testing.assert_close(get_act_fn("gelu_new")(x), F.gelu(x, approximate="tanh"))
    torch.testing.assert_close(get_act_fn("relu")(x), F.relu(x))
    torch.testing.assert_close(GeluAndMul()(x), F.gelu(x[:, :5], approximate="tanh") * x[:, 5:])
    with pytest.raises(ValueError, match="activation 'swish2' is not supported; supported: relu"):
        get_act_fn("swish2")
