"""Every compiled op three ways on this machine, each against a torch reference:
- "native": the kernels of the CPU's own ISA (avx2 on every x86 test machine so far);
- "generic": the generic-ISA builds (scalar code, no -march=native): paged attention and
  the layer ops are compiled, the AVX2-only extensions are absent and their torch paths run;
- "torch": no extension at all (as where nothing builds, or compiled kernels are off).
Each test also asserts which implementation the dispatch picked in that mode."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F

from pagedllm import kernels
from pagedllm.kernels import bf16, build
from pagedllm.layers.activation import SiluAndMul
from pagedllm.attention.layouts import CONTIGUOUS_SLOTS
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.ops import write_kv
from pagedllm.config import AttentionConfig
from tests.attention_utils import backend_attention, reference_attention
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from tests.worker.test_attention import HKV, GROUP, _metadata

MODES = ["native", "generic", "torch"]


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "torch":
        monkeypatch.setattr(build, "_enabled", False)  # as AttentionConfig.compiled_kernels=False
        monkeypatch.setattr(build, "_loaded", {})  # nothing loaded: every lookup says None
        monkeypatch.setattr(bf16, "_use_kernels", {})
    # "native" is the CPU's own ISA even where PAGEDLLM_CPU_ISA selects another for the run.
    kernels.set_cpu_isa("generic" if request.param == "generic" else kernels.detect_cpu_isa())
    try:
        yield request.param
    finally:
        kernels.set_cpu_isa(None)


def _expect(mode: str, name: str) -> str | None:
    """The module name the dispatch must return for extension `name` in `mode` (None: torch)."""
    ext, isa = build.EXTENSIONS[name], kernels.cpu_isa()
    if mode == "torch" or not kernels.isa_at_least(isa, ext.min_isa):
        return None
    return build.module_name(ext, isa)


def _check_dispatch(mode: str, name: str) -> None:
    module = build.extension(name)
    assert (module and module.__name__) == _expect(mode, name)


def test_native_isa_is_at_least_avx2_where_the_cpu_has_it() -> None:
    flags = Path("/proc/cpuinfo").read_text()
    has_avx2 = all(f" {f}" in flags for f in ("avx2", "fma", "f16c", "bmi2"))
    assert kernels.isa_at_least(kernels.detect_cpu_isa(), "avx2") == has_avx2  # the ladder: test_build.py


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(mode: str, dtype: torch.dtype) -> None:
    _check_dispatch(mode, "layer_ops")
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(96, 1e-5).to(dtype)
    norm.weight.data = torch.randn(96, generator=gen).to(dtype)
    x, residual = (torch.randn(5, 96, generator=gen).to(dtype) for _ in range(2))

    def want(v: torch.Tensor) -> torch.Tensor:
        vf = v.float()
        return norm.weight * (vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)

    tol = dict(atol=2e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-6, rtol=2**-7)
    torch.testing.assert_close(norm(x), want(x), **tol)
    normed, summed = norm(x, residual)
    assert torch.equal(summed, residual + x)
    torch.testing.assert_close(normed, want(residual + x), **tol)


def test_rotary(mode: str) -> None:
    _check_dispatch(mode, "layer_ops")
    gen = torch.Generator().manual_seed(2)
    rope = RotaryEmbedding(32, 256, {"rope_type": "default", "rope_theta": 10000.0})
    positions = torch.tensor([0, 7, 3, 255])
    qk = torch.randn(4, 6 * 32, generator=gen)
    q, k = qk[:, : 4 * 32], qk[:, 4 * 32 :]  # strided views of one projection, as the models pass

    def want(x: torch.Tensor) -> torch.Tensor:
        cos, sin = rope.cos_sin_cache[positions][:, None, :].chunk(2, dim=-1)
        x1, x2 = x.reshape(4, -1, 32).chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).reshape(4, -1)

    got_q, got_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, want(q), atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, want(k), atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("rows", [1, 9])
def test_silu_and_mul(mode: str, rows: int) -> None:
    _check_dispatch(mode, "layer_ops")
    x = torch.randn(rows, 2 * 45, generator=torch.Generator().manual_seed(rows))  # a tail past 8 lanes
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(gate) * up, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("D", [64, 12])  # the kernel's vector passes and its scalar tails
def test_paged_decode_attention(mode: str, D: int) -> None:
    _check_dispatch(mode, "paged_attention")
    torch.manual_seed(0)
    computed = [17, 3, 0]
    md = _metadata(computed, [1, 1, 1])
    cache = torch.zeros(2, 64, 4, HKV, D)
    for i, c in enumerate(computed):
        for p in range(c):
            slot = int(md.block_tables[i, p // 4]) * 4 + p % 4
            cache.view(2, -1, HKV, D)[:, slot] = torch.randn(2, HKV, D)
    q, k, v = torch.randn(3, HKV * GROUP, D), torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    write_kv(cache, k, v, md.slot_mapping)
    for window, cap in ((None, None), (5, None), (None, 1.5), (5, 1.5)):  # cap 1.5 bites: |scores| reach ~4
        want = reference_attention(q, cache, md, 0.3, window, cap)
        got = backend_attention(AttentionConfig(), q, k, v, cache, md, 0.3, window, logit_soft_cap=cap)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_contiguous_decode_attention(mode: str) -> None:
    _check_dispatch(mode, "paged_attention")
    torch.manual_seed(0)
    D, capacity, slots, computed = 64, 32, [2, 0, 3], [17, 3, 0]
    cache = torch.zeros(2, 4, capacity, HKV, D)
    for slot, c in zip(slots, computed):
        cache[:, slot, :c] = torch.randn(2, c, HKV, D)
    seq_lens = [c + 1 for c in computed]
    md = AttentionMetadata(
        slot_mapping=torch.tensor([s * capacity + c for s, c in zip(slots, computed)]),
        block_tables=torch.zeros((0, 0), dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens),
        query_start_loc=[0, 1, 2, 3],
        seq_lens_list=seq_lens,
        num_decodes=3,
        block_size=1,
        slots=torch.tensor(slots),
        slots_list=slots,
    )
    q, k, v = torch.randn(3, HKV * GROUP, D), torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    write_kv(cache, k, v, md.slot_mapping)
    for cap in (None, 1.5):
        want = reference_attention(q, cache, md, 0.3, None, cap, layout=CONTIGUOUS_SLOTS)
        got = backend_attention(AttentionConfig(), q, k, v, cache, md, 0.3, None, cap, layout=CONTIGUOUS_SLOTS)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 5, 40, 200])  # int16 / 8-row tiles / panels / dequantize + GEMM
def test_quantized_linear(mode: str, bits: int, rows: int) -> None:
    _check_dispatch(mode, "quant_linear")
    gen = torch.Generator().manual_seed(rows + bits)
    weight = kernels.quantize(torch.randn(48, 96, generator=gen), bits)
    x, bias = torch.randn(rows, 96, generator=gen), torch.randn(48, generator=gen)
    want = F.linear(x, weight.dequantize(), bias)
    # rows <= 2 on the kernel round activations to int16 (1/65534 of a group's largest |x|).
    atol = 2e-3 if rows <= kernels.INT16_MAX_ROWS and _expect(mode, "quant_linear") else 1e-4
    torch.testing.assert_close(kernels.quantized_linear(x, weight, bias), want, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("rows", [3, kernels.KERNEL_MAX_ROWS + 1])
def test_bf16_linear(mode: str, rows: int) -> None:
    # Where the CPU computes bf16 natively, torch's matmul is used in every mode.
    expect = _expect(mode, "bf16_linear") is not None and not kernels.native_bf16()
    assert kernels.use_bf16_kernels() == expect
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 64, generator=gen).bfloat16(), torch.randn(40, 64, generator=gen).bfloat16()
    want = F.linear(x.float(), w.float()).bfloat16().float()
    # persistent_weight lets zentorch (AMD CPUs) cache a packed copy by the weight's address: a
    # new weight where an earlier case's freed one was would be served stale unless the caches
    # are cleared, as the weight loaders do (kernels/linear.py).
    kernels.clear_weight_caches()
    got = kernels.linear_op(x, w, persistent_weight=True)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=2**-7)


@pytest.mark.slow
def test_fused_decode_layers(mode: str, tmp_path: Path) -> None:
    """The fused decode forward where it built, the module path where not: same decode."""
    from pagedllm.models.loader import load_model
    from tests.models.test_fused_decode import compare_decode_steps
    from tests.models.test_llama import tiny_config
    from tests.models.utils import bind_kv_caches, save_tiny_model

    save_tiny_model(tmp_path, tiny_config("llama"))
    loaded = load_model(str(tmp_path), quantization="int4")
    bind_kv_caches(loaded.model, num_blocks=17, block_size=4)
    fused_calls = compare_decode_steps(loaded, 2, steps=3, atol=0.0)
    assert fused_calls == (3 if _expect(mode, "decode_layers") else 0)


def test_chunked_gemm_buffer_first_made_under_inference_mode() -> None:
    """The reused expansion buffer, first allocated inside inference mode (the runner), stays
    writable for a later call outside it (an inference tensor would refuse the in-place fill)."""
    from pagedllm.kernels import gemm

    gemm._buffers.clear()
    x, w = torch.randn(3, 8), torch.randn(5, 8)

    def fill(start: int, buf: torch.Tensor) -> None:
        buf.copy_(w[start : start + buf.shape[0]])

    with torch.inference_mode():
        inside = gemm.chunked_gemm(x, 5, fill)
    outside = gemm.chunked_gemm(x, 5, fill)
    torch.testing.assert_close(inside, x @ w.t())
    torch.testing.assert_close(outside, x @ w.t())
