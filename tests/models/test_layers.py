"""Shared layers: weight loaders, the linear kernel choice, RMSNorm, rotary, activation."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.embedding import LMHead, VocabEmbedding
from pagedllm.layers.linear import Linear, MergedLinear, QKVLinear, linear_op
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import get_rope


def test_qkv_linear_loads_shards_in_place() -> None:
    layer = QKVLinear(hidden_size=8, head_dim=2, num_heads=4, num_kv_heads=2, bias=True)
    q, k, v = torch.randn(8, 8), torch.randn(4, 8), torch.randn(4, 8)
    for shard, w in (("v", v), ("q", q), ("k", k)):  # any order
        layer.weight.weight_loader(layer.weight, w, shard)
        layer.bias.weight_loader(layer.bias, w[:, 0], shard)
    assert torch.equal(layer.weight, torch.cat([q, k, v]))
    x = torch.randn(3, 8)
    out_q, out_k, out_v = layer.split(layer(x))
    torch.testing.assert_close(out_k, F.linear(x, k, k[:, 0]))
    with pytest.raises(ValueError, match="shard_id"):
        layer.weight.weight_loader(layer.weight, q, "o")
    with pytest.raises(ValueError, match="does not fit"):
        layer.weight.weight_loader(layer.weight, q, "k")


def test_merged_linear_loads_gate_and_up() -> None:
    layer = MergedLinear(6, [5, 5])
    gate, up = torch.randn(5, 6), torch.randn(5, 6)
    layer.weight.weight_loader(layer.weight, up, 1)
    layer.weight.weight_loader(layer.weight, gate, 0)
    assert torch.equal(layer.weight, torch.cat([gate, up]))
    with pytest.raises(ValueError, match="shard_id"):
        layer.weight.weight_loader(layer.weight, gate, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 130])
def test_linear_op_matches_torch(dtype: torch.dtype, num_tokens: int) -> None:
    x = torch.randn(num_tokens, 96).to(dtype)
    w, b = torch.randn(200, 96).to(dtype), torch.randn(200).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    # A temporary weight always takes the plain torch path (kernels cache weights by address).
    torch.testing.assert_close(linear_op(x, w, b), F.linear(x, w, b), atol=tol, rtol=tol)
    # A module-owned weight, written through its loader, may take the fast kernel.
    layer = Linear(96, 200, bias=True).to(dtype)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    got = linear_op(x, layer.weight, layer.bias, persistent_weight=True)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=tol, rtol=tol)


def test_linear_sees_reloaded_weights() -> None:
    # Kernels may cache packed weights by address; a reload must never be served stale.
    layer = Linear(64, 32)
    x = torch.randn(4, 64)
    for _ in range(3):
        layer.weight.weight_loader(layer.weight, torch.randn(32, 64))
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-4, rtol=1e-4)


def test_tied_lm_head_shares_embedding() -> None:
    emb, head = VocabEmbedding(10, 4), LMHead(10, 4)
    head.tie(emb)
    emb.weight.weight_loader(emb.weight, torch.randn(10, 4))
    h = torch.randn(2, 4)
    torch.testing.assert_close(head(h), h @ emb.weight.T)
    assert torch.equal(emb(torch.tensor([3])), emb.weight[3:4])


@pytest.mark.parametrize("path", ["torch", "compiled"])
def test_rms_norm_matches_hf_and_fuses_residual(path: str, monkeypatch) -> None:
    """The torch formulation is HF's, bit for bit; the compiled layer op (another summation
    order for the mean of squares) agrees to float32 rounding."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from pagedllm.kernels import build

    if path == "torch":
        monkeypatch.setitem(build._loaded, ("layer_ops", build.cpu_isa()), None)
        tol = dict(atol=0, rtol=0)
    else:
        assert build.layer_ops() is not None, "the layer ops extension did not build"
        tol = dict(atol=2e-6, rtol=1e-6)
    torch.manual_seed(0)
    ref = LlamaRMSNorm(16, eps=1e-5)
    ref.weight.data = torch.randn(16)
    ours = RMSNorm(16, eps=1e-5)
    ours.weight.data.copy_(ref.weight.data)
    x, residual = torch.randn(5, 16), torch.randn(5, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), **tol)
        normed, new_residual = ours(x, residual)
        torch.testing.assert_close(new_residual, residual + x, atol=0, rtol=0)
        torch.testing.assert_close(normed, ref(residual + x), **tol)


def test_silu_and_mul() -> None:
    x = torch.randn(3, 10)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :5]) * x[:, 5:])


ROPES: list[dict[str, Any]] = [
    {"rope_type": "default", "rope_theta": 100000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: r["rope_type"])
def test_rotary_matches_hf(rope: dict[str, Any]) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, rope_parameters=rope,
    )  # fmt: skip
    head_dim, num_tokens = 32, 9
    positions = torch.tensor([0, 1, 2, 7, 100, 511, 1000, 1500, 2047])
    q, k = torch.randn(num_tokens, 4 * head_dim), torch.randn(num_tokens, 2 * head_dim)
    ours_q, ours_k = get_rope(head_dim, 2048, config)(positions, q, k)

    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])  # [1, T, D]
    # HF layout: [batch, heads, T, D]
    hq = q.view(1, num_tokens, 4, head_dim).transpose(1, 2)
    hk = k.view(1, num_tokens, 2, head_dim).transpose(1, 2)
    ref_q, ref_k = apply_rotary_pos_emb(hq, hk, cos, sin)
    ref_q, ref_k = (r.transpose(1, 2).reshape(num_tokens, -1) for r in (ref_q, ref_k))
    torch.testing.assert_close(ours_q, ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_k, ref_k, atol=1e-5, rtol=1e-5)


def test_unsupported_rope_type() -> None:
    from transformers import LlamaConfig

    # yarn is supported since gpt-oss (test_gpt_oss.py); dynamic (NTK scaling) is not
    config = LlamaConfig(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError, match="supported: default, linear, llama3"):
        get_rope(64, 128, config)
