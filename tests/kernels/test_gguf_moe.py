"""The grouped-expert call (csrc/gguf_moe.h, kernels/gguf_moe.py) against the per-expert loop
of layers/moe.py's formulation (gguf_linear per expert, silu-and-mul, weighted index_add in
expert order), for every kept type, under the CPU's ISA (the int16 path where it has one), the
avx2 and the generic builds (the float path).

Up to 16 rows per expert both sides round activations alike (gguf_linear's small-M rounding of
each row, per group of 32) and sum each dot in the same order, so they differ only where
silu's exp differs by an ulp and moves an int16 rounding of the down projection's input:
bounded here by 1e-4 of the output's largest magnitude (measured on the native build: at most
2e-7 of it, a quarter of the cases bitwise equal). At 64 tokens (a prefill chunk) the loop's
experts take 64 rows, dequantize-and-GEMM in float32 activations: the int16 rounding's own
error then shows, within the same bound."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.gguf_blocks import KEPT_GGUF_TYPES, GGUFBlocks, gguf_linear
from pagedllm.kernels.gguf_moe import ExpertStacks, grouped_experts, stack_expert_blocks, stack_rows
from tests.kernels.test_gguf_kernels import gguf_ops_at, random_blocks

E, H, I = 8, 256, 256  # K of every projection a whole number of 256-element blocks
RTOL = 1e-4


@pytest.fixture(params=["native", "avx2", "generic"])
def ops(request):  # type: ignore[no-untyped-def]
    """The extension at the CPU's level (the int16 path where built), at avx2 and generic (the
    float path's AVX2 and scalar dots), selected for gguf_linear's lookups too."""
    yield from gguf_ops_at(request.param)


def random_stacks(gate_up_type: str, down_type: str, seed: int = 0) -> ExpertStacks:
    gu = torch.stack([random_blocks(gate_up_type, 2 * I, H, seed=seed + e).data for e in range(E)])
    dn = torch.stack([random_blocks(down_type, H, I, seed=seed + 100 + e).data for e in range(E)])
    return ExpertStacks(gu, gate_up_type, dn, down_type)


def loop_reference(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, s: ExpertStacks, decode_activations: str = "int16"
) -> torch.Tensor:
    """layers/moe.py's loop: per expert in id order, its tokens' rows through gguf_linear."""
    out = torch.zeros_like(x)
    flat = ids.flatten()
    k = ids.shape[1]
    for e in range(E):
        pairs = (flat == e).nonzero().flatten()  # ascending: tokens in order, as the stable argsort
        if len(pairs) == 0:
            continue
        tokens = pairs // k
        gate_up = GGUFBlocks(s.gate_up[e], s.gate_up_type, H)
        gate, up = gguf_linear(x[tokens], gate_up, decode_activations=decode_activations).chunk(2, dim=-1)
        h = torch.nn.functional.silu(gate) * up
        y = gguf_linear(h, GGUFBlocks(s.down[e], s.down_type, I), decode_activations=decode_activations)
        y = y * weights.flatten()[pairs, None]
        out.index_add_(0, tokens, y)
    return out


def random_routing(num_tokens: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=g) + 0.1
    return ids, weights


def assert_close_to_loop(out: torch.Tensor, ref: torch.Tensor, label: str) -> None:
    scale = ref.abs().max().item()
    err = (out - ref).abs().max().item()
    assert err <= RTOL * scale, f"{label}: max |diff| {err:.3e} over max |ref| {scale:.3e}"


@pytest.mark.parametrize("type_name", KEPT_GGUF_TYPES)
def test_grouped_matches_the_loop_for_every_type(ops, type_name: str) -> None:  # type: ignore[no-untyped-def]
    s = random_stacks(type_name, type_name)
    for num_tokens, top_k in [(t, k) for t in (1, 3, 16) for k in (1, 2, 8)] + [(64, 8)]:  # 64: a prefill chunk
        seed = 7 * num_tokens + top_k
        x = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(seed))
        ids, weights = random_routing(num_tokens, top_k, seed)
        counts = torch.bincount(ids.flatten(), minlength=E)
        # Some experts idle and some shared by several tokens, wherever T and k allow it.
        assert (num_tokens * top_k >= E or (counts == 0).any()) and (num_tokens == 1 or top_k == 1 or counts.max() > 1)
        assert_close_to_loop(
            grouped_experts(x, ids, weights, s), loop_reference(x, ids, weights, s), f"{type_name} T={num_tokens} k={top_k}"
        )


@pytest.mark.parametrize(("gate_up_type", "down_type"), [("Q4_K", "Q6_K"), ("Q5_K", "Q8_0"), ("Q4_0", "Q3_K")])
def test_mixed_types_and_repeated_expert_in_one_token(ops, gate_up_type: str, down_type: str) -> None:  # type: ignore[no-untyped-def]
    # A Q4_K_M file's experts: gate/up Q4_K, down Q6_K. An expert twice in one token's slots
    # (not something top-k gives, but the call's contract): both slots count.
    s = random_stacks(gate_up_type, down_type, seed=3)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[5, 5], [0, 5], [7, 2]])
    weights = torch.tensor([[0.25, 0.5], [1.0, 2.0], [0.75, 0.125]])
    out = grouped_experts(x, ids, weights, s)
    assert_close_to_loop(out, loop_reference(x, ids, weights, s), f"{gate_up_type}/{down_type}")
    # Token 0's two slots of expert 5 equal one slot of weight 0.75.
    single = grouped_experts(x[:1], torch.tensor([[5]]), torch.tensor([[0.75]]), s)
    assert_close_to_loop(out[:1], single, "repeated expert")


@pytest.mark.parametrize(("gate_up_type", "down_type"), [("Q4_K", "Q6_K"), ("Q5_K", "Q5_K"), ("Q4_K", "Q8_0")])
def test_int8_activations_match_the_loop_in_int8(gate_up_type: str, down_type: str) -> None:
    """With int8 activations (the experts' decode_activations "int8": the bf16 and int8 matmul
    modes) the K-quant projections round x and h to int8 per 256 in both the grouped call and
    the loop's gguf_linear (a Q8_0 down keeps int16 in both); an ulp of silu's exp can move one
    int8 rounding of h (1/254 of a block's largest |h|), hence a looser bound than int16's.
    Against the int16 call it differs by the int8 rounding itself (stated drift, ~1%)."""
    ops_list = list(gguf_ops_at("native"))
    if not ops_list or "avx512_vnni" not in " ".join(ops_list[0].small_m_kernels()):
        pytest.skip("no AVX-512 VNNI: no int8 dot in this build")
    s = random_stacks(gate_up_type, down_type, seed=11)
    for num_tokens, top_k in [(1, 8), (4, 2), (16, 8)]:
        x = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(num_tokens))
        ids, weights = random_routing(num_tokens, top_k, num_tokens)
        out = grouped_experts(x, ids, weights, s, int8_activations=True)
        ref = loop_reference(x, ids, weights, s, decode_activations="int8")
        scale = ref.abs().max().item()
        assert (out - ref).abs().max().item() <= 2e-3 * scale, f"{gate_up_type}/{down_type} T={num_tokens}"
        exact = grouped_experts(x, ids, weights, s)
        drift = ((out - exact).norm() / exact.norm()).item()
        assert 1e-4 < drift < 3e-2, drift  # the int8 path ran, and within its stated drift


def test_dtype_and_checks(ops) -> None:  # type: ignore[no-untyped-def]
    s = random_stacks("Q8_0", "Q8_0")
    x = torch.randn(2, H)
    ids, weights = random_routing(2, 2, 0)
    out = grouped_experts(x.to(torch.bfloat16), ids, weights.to(torch.bfloat16), s)
    assert out.dtype == torch.bfloat16 and out.shape == (2, H)
    with pytest.raises(RuntimeError, match="out of range"):
        grouped_experts(x, torch.tensor([[0, E], [1, 2]]), weights, s)
    with pytest.raises(RuntimeError, match="share E"):
        grouped_experts(x[:, :64], ids, weights, s)


def test_stack_rows_views_slices_of_one_tensor_and_copies_others() -> None:
    base = torch.arange(4 * 3 * 5, dtype=torch.uint8).reshape(4, 3, 5)
    stacked = stack_rows([base[e] for e in range(4)])
    assert stacked.data_ptr() == base.data_ptr() and torch.equal(stacked, base)
    parts = [base[e].clone() for e in range(4)]
    copied = stack_rows(parts)
    assert copied.data_ptr() != parts[0].data_ptr() and torch.equal(copied, base)
    assert not torch.equal(stack_rows([base[1], base[0]]), base)  # out of order: a copy, in the given order
    blocks = [random_blocks("Q4_K", 2 * I, H, seed=e) for e in range(2)]
    down = [random_blocks("Q6_K", H, I, seed=e) for e in range(2)]
    stacks, gu_views, down_views = stack_expert_blocks(blocks, down)
    assert gu_views[1].data.data_ptr() == stacks.gate_up[1].data_ptr() and torch.equal(gu_views[1].data, blocks[1].data)
    assert down_views[0].type_name == stacks.down_type == "Q6_K"
    with pytest.raises(ValueError, match="differ in type"):
        stack_expert_blocks([blocks[0], random_blocks("Q5_K", 2 * I, H)], down)
