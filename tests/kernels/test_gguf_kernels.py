"""The compiled GGUF block kernels (csrc/gguf_blocks.cpp) for every kept type, under the CPU's
ISA and the generic one: the row decoder and the gather against gguf-py's dequantizer, and
gguf_linear (both small-M paths and the prefill GEMM) against float64 math over it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from pagedllm.kernels import build, isa
from pagedllm.kernels.gguf_blocks import (
    GGUF_BLOCK_GEOMETRY,
    INT8_DECODE_TYPES,
    INT8_SMALL_M_MAX_ROWS,
    KEPT_GGUF_TYPES,
    SMALL_M_MAX_ROWS,
    GGUFBlocks,
    gguf_embedding_lookup,
    gguf_linear,
)

# Byte offsets of each type's fp16 scale fields inside a block (the rest are code bytes,
# valid whatever their value); MXFP4's e8m0 exponent is byte 0.
_FP16_FIELDS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
    "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
}
ISAS = ["native", "generic"]


def random_blocks(type_name: str, n: int, k: int, seed: int = 0) -> GGUFBlocks:
    """N rows of K elements of random but valid blocks: random code bytes, the scale fields
    finite and moderate (fp16 of magnitude 2^-8 .. 1, either sign; e8m0 exponents 120..132)."""
    rng = np.random.default_rng(seed)
    elems, nbytes = GGUF_BLOCK_GEOMETRY[type_name]
    blocks = rng.integers(0, 256, size=(n * k // elems, nbytes), dtype=np.uint8)
    if type_name in ("F16", "BF16"):
        values = rng.standard_normal(n * k).astype(np.float32)
        bits = values.astype(np.float16).view(np.uint16) if type_name == "F16" else values.view(np.uint32) >> 16
        blocks = bits.astype(np.uint16).view(np.uint8).reshape(-1, 2)
    elif type_name == "MXFP4":
        blocks[:, 0] = rng.integers(120, 133, size=blocks.shape[0])
    for off in _FP16_FIELDS.get(type_name, ()):
        mag = np.exp2(rng.uniform(-8, 0, size=blocks.shape[0])) * rng.choice([-1, 1], size=blocks.shape[0])
        blocks[:, off : off + 2] = mag.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return GGUFBlocks(torch.from_numpy(blocks.reshape(n, -1).copy()), type_name, k)


def gguf_py_dequantize(w: GGUFBlocks) -> torch.Tensor:
    """float64 [N, K] from gguf-py (F16/BF16 widened by numpy)."""
    raw = w.data.numpy()
    if w.type_name == "F16":
        out = raw.view(np.float16).astype(np.float64)
    elif w.type_name == "BF16":
        out = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    else:
        out = dequantize(raw, GGMLQuantizationType[w.type_name]).astype(np.float64)
    return torch.from_numpy(out.reshape(w.shape))


def gguf_ops_at(level: str):  # type: ignore[no-untyped-def]
    """Yields the extension built for `level` ("native": the CPU's own), selected for
    gguf_linear's own lookups too, and selects the CPU's level again after; skips where the CPU
    lacks the level or the build fails (a fixture's body)."""
    native = isa.detect_cpu_isa()
    chosen = native if level == "native" else level
    if not isa.isa_at_least(native, chosen):
        pytest.skip(f"the CPU has no {chosen}")
    isa.set_cpu_isa(chosen)
    module = build.gguf_linear_ops()
    if module is None:
        isa.set_cpu_isa(None)
        pytest.skip(f"the gguf_linear extension did not build for {chosen}")
    yield module
    isa.set_cpu_isa(None)


@pytest.fixture(params=ISAS)
def ops(request):  # type: ignore[no-untyped-def]
    """The extension built for the CPU's ISA, then for the generic one (the scalar fallback)."""
    yield from gguf_ops_at(request.param)


def _k_values(type_name: str) -> list[int]:
    elems = GGUF_BLOCK_GEOMETRY[type_name][0]
    # One block; then several, past one 256-element span with a short tail where blocks allow.
    return [elems, 77] if elems == 1 else [elems, elems * (9 if elems == 32 else 3)]


@pytest.mark.parametrize("type_name", KEPT_GGUF_TYPES)
def test_dequantize_and_gather_match_gguf_py(ops, type_name: str) -> None:  # type: ignore[no-untyped-def]
    for k in _k_values(type_name):
        w = random_blocks(type_name, 7, k, seed=k)
        ref = gguf_py_dequantize(w)
        scale = float(ref.abs().max())
        buf = torch.empty(4, k)
        ops.dequantize_rows(w.data, list(ops.type_names()).index(type_name), 2, buf)
        torch.testing.assert_close(buf.double(), ref[2:6], rtol=1e-6, atol=1e-6 * scale)
        torch.testing.assert_close(w.dequantize().double(), ref, rtol=1e-6, atol=1e-6 * scale)
        ids = torch.tensor([6, 0, 3, 3])
        got = gguf_embedding_lookup(ids, w, torch.float32)
        torch.testing.assert_close(got.double(), ref[ids], rtol=1e-6, atol=1e-6 * scale)


def _check_linear(y: torch.Tensor, x: torch.Tensor, w64: torch.Tensor, int16: bool) -> None:
    """y against float64 x @ w.T: float32 rounding (1e-5 of sum |x||w| per output), plus for
    the int16-activation path the activations' rounding (half a step, 1/65534 of their group
    of 32's largest |x|, times |w|)."""
    x64 = x.double()
    ref = x64 @ w64.T
    bound = 1e-5 * (x64.abs() @ w64.abs().T) + 1e-30
    if int16:
        k = x.shape[1]
        g = min(32, k)
        amax = x64.abs().view(x.shape[0], k // g, g).amax(-1, keepdim=True).expand(-1, -1, g).reshape(x.shape)
        bound = bound + 1.001 * (amax / 65534) @ w64.abs().T
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"max excess {float((err - bound).max())}"


@pytest.mark.parametrize("type_name", KEPT_GGUF_TYPES)
def test_linear_matches_float64(ops, type_name: str) -> None:  # type: ignore[no-untyped-def]
    kernels = dict(zip(ops.type_names(), ops.small_m_kernels()))
    int16 = kernels[type_name].startswith("int16")
    gen = torch.Generator().manual_seed(1)
    for k in _k_values(type_name):
        w = random_blocks(type_name, 13, k, seed=k + 1)  # 13 rows: no row tile divides it
        w64 = gguf_py_dequantize(w)
        for m in (1, 3, SMALL_M_MAX_ROWS, SMALL_M_MAX_ROWS + 1, 200):
            x = torch.randn(m, k, generator=gen)
            _check_linear(gguf_linear(x, w), x, w64, int16 and m <= SMALL_M_MAX_ROWS)
        x = torch.randn(5, k, generator=gen)
        idx = list(ops.type_names()).index(type_name)
        _check_linear(ops.linear(x, w.data, idx, "float"), x, w64, False)


@pytest.mark.parametrize("type_name", KEPT_GGUF_TYPES)
def test_int16_path_matches_its_rounded_activations(type_name: str) -> None:
    """The int16-activation kernel, where built for the type, against float64 math over the
    activations rounded as it documents (round-half-even of x * 32767 / absmax per group of 32,
    in float32): only float32 summation rounding may differ (1e-5 of sum |w||x rounded|)."""
    isa.set_cpu_isa(None)
    ops = build.gguf_linear_ops()
    if ops is None or not dict(zip(ops.type_names(), ops.small_m_kernels()))[type_name].startswith("int16"):
        pytest.skip(f"no int16-activation kernel for {type_name} in this build")
    idx = list(ops.type_names()).index(type_name)
    gen = torch.Generator().manual_seed(2)
    for k in _k_values(type_name) + [GGUF_BLOCK_GEOMETRY[type_name][0] * 3]:
        w = random_blocks(type_name, 11, k, seed=k + 2)
        w64 = gguf_py_dequantize(w)
        x = torch.randn(6, k, generator=gen)
        x[1, :32] = 0.0  # a group of zeros (scale 0)
        xg = x.view(6, -1, 32)
        amax = xg.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, 32767.0 / amax, torch.zeros_like(amax))
        xr = (torch.round(xg * inv) * (amax / 32767.0)).view(6, k).double()  # what the kernel multiplies
        ref = xr @ w64.T
        bound = 1e-5 * (xr.abs() @ w64.abs().T) + 1e-30
        err = (ops.linear(x, w.data, idx, "int16").double() - ref).abs()
        assert bool((err <= bound).all()), f"K={k}: max excess {float((err - bound).max())}"


@pytest.mark.parametrize("type_name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS"])
def test_int16_path_rows_do_not_depend_on_m(type_name: str) -> None:
    """Each output of the int16 kernel is computed alike whatever M (activation rows are taken
    4, 3, 2 or 1 at a time): a row alone equals the same row inside a batch of every size, bit
    for bit, as the fused decode's batch-invariance relies on."""
    isa.set_cpu_isa(None)
    ops = build.gguf_linear_ops()
    if ops is None or not dict(zip(ops.type_names(), ops.small_m_kernels()))[type_name].startswith("int16"):
        pytest.skip(f"no int16-activation kernel for {type_name} in this build")
    idx = list(ops.type_names()).index(type_name)
    k = GGUF_BLOCK_GEOMETRY[type_name][0] * (9 if GGUF_BLOCK_GEOMETRY[type_name][0] == 32 else 3)
    w = random_blocks(type_name, 37, k, seed=5)
    x = torch.randn(SMALL_M_MAX_ROWS, k, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([ops.linear(x[i : i + 1].contiguous(), w.data, idx, "int16") for i in range(x.shape[0])])
    for m in range(2, SMALL_M_MAX_ROWS + 1):
        assert torch.equal(ops.linear(x[:m].contiguous(), w.data, idx, "int16"), alone[:m]), m


def _int8_ops():  # type: ignore[no-untyped-def]
    """The extension where its build holds the int8-activation kernel (AVX-512 VNNI), else skip."""
    isa.set_cpu_isa(None)
    ops = build.gguf_linear_ops()
    if ops is None or not {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= _cpu_flags():
        pytest.skip("no AVX-512 VNNI: no int8-activation kernel in this build")
    return ops


@pytest.mark.parametrize("type_name", INT8_DECODE_TYPES)
def test_int8_path_matches_its_rounded_activations(type_name: str) -> None:
    """The int8-activation kernel (csrc/gguf_dot_int8_avx512.h) against float64 math over the
    activations rounded as it documents (round-half-even of x * 127 / absmax per block of 256,
    in float32): the integer pipeline is exact, so only float32 summation rounding may differ."""
    ops = _int8_ops()
    idx = list(ops.type_names()).index(type_name)
    gen = torch.Generator().manual_seed(4)
    for k in (256, 768, 2048):
        w = random_blocks(type_name, 13, k, seed=k + 4)
        w64 = gguf_py_dequantize(w)
        x = torch.randn(6, k, generator=gen) * torch.exp(torch.randn(6, 1, generator=gen))
        x[1, :256] = 0.0  # a block of zeros (scale 0)
        x[2, 5] = 40.0  # an outlier: the block's scale follows it
        xb = x.view(6, -1, 256)
        amax = xb.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        xr = (torch.round(xb * inv) * (amax / 127.0)).view(6, k).double()
        ref = xr @ w64.T
        bound = 1e-5 * (xr.abs() @ w64.abs().T) + 1e-30
        err = (ops.linear(x, w.data, idx, "int8").double() - ref).abs()
        assert bool((err <= bound).all()), f"K={k}: max excess {float((err - bound).max())}"


@pytest.mark.parametrize("type_name", INT8_DECODE_TYPES)
def test_int8_path_drift_and_batch_invariance(type_name: str) -> None:
    """The stated drift of int8 activations against float32 ones (kernels/gguf_blocks.py
    DECODE_ACTIVATIONS): on Gaussian activations the relative error of a matmul is about 0.7%
    (bounded here at 1.2%, against below 1e-4 for the int16 path); and each output row is the
    same whatever M (rows taken 4, 3, 2 or 1 at a time)."""
    ops = _int8_ops()
    idx = list(ops.type_names()).index(type_name)
    w = random_blocks(type_name, 96, 2048, seed=6)
    x = torch.randn(SMALL_M_MAX_ROWS, 2048, generator=torch.Generator().manual_seed(7))
    ref = ops.linear(x, w.data, idx, "float")
    rel = lambda y: float((y - ref).norm() / ref.norm())  # noqa: E731
    assert rel(ops.linear(x, w.data, idx, "int8")) < 1.2e-2
    if dict(zip(ops.type_names(), ops.small_m_kernels()))[type_name].startswith("int16"):  # Q3_K has none
        assert rel(ops.linear(x, w.data, idx, "int16")) < 1e-4
    alone = torch.cat([ops.linear(x[i : i + 1].contiguous(), w.data, idx, "int8") for i in range(x.shape[0])])
    for m in range(2, SMALL_M_MAX_ROWS + 1):
        assert torch.equal(ops.linear(x[:m].contiguous(), w.data, idx, "int8"), alone[:m]), m
    # gguf_linear with int8 decode activations takes the int8 kernel up to INT8_SMALL_M_MAX_ROWS
    # rows, bf16 panels past it; int16 only up to SMALL_M_MAX_ROWS
    x64 = torch.randn(INT8_SMALL_M_MAX_ROWS + 1, 2048, generator=torch.Generator().manual_seed(8))
    m = INT8_SMALL_M_MAX_ROWS
    assert torch.equal(gguf_linear(x64[:m], w, None, 17, "int8"), ops.linear(x64[:m], w.data, idx, "int8"))
    assert torch.equal(gguf_linear(x64, w, None, 17, "int8"), gguf_linear(x64, w, None, 17, "int16"))  # panels
    assert not torch.equal(gguf_linear(x64[:m], w, None, 17, "int16"), ops.linear(x64[:m], w.data, idx, "int8"))
    # "fast" is int8 for these types, the build's choice for the others
    assert torch.equal(ops.linear(x, w.data, idx, "fast"), ops.linear(x, w.data, idx, "int8"))
    q8 = list(ops.type_names()).index("Q8_0")
    w8 = random_blocks("Q8_0", 8, 256, seed=1)
    assert torch.equal(ops.linear(x[:, :256].contiguous(), w8.data, q8, "fast"),
                       ops.linear(x[:, :256].contiguous(), w8.data, q8, ""))
    with pytest.raises(RuntimeError, match="no int8 kernel"):
        ops.linear(x[:, :256].contiguous(), w8.data, q8, "int8")


def test_linear_keeps_dtype_shape_and_bias() -> None:
    w = random_blocks("Q4_K", 5, 256)
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    bias = torch.randn(5)
    y = gguf_linear(x, w, bias)
    assert y.shape == (2, 3, 5) and y.dtype == torch.bfloat16
    ref = x.float().reshape(6, 256) @ w.dequantize().T + bias
    torch.testing.assert_close(y.float().reshape(6, 5), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


def test_without_the_extension_the_reference_runs(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from pagedllm.kernels import gguf_blocks

    monkeypatch.setattr(gguf_blocks, "gguf_linear_ops", lambda: None)
    w = random_blocks("Q6_K", 9, 512)
    w64 = gguf_py_dequantize(w)
    for m in (1, 20):
        x = torch.randn(m, 512)
        _check_linear(gguf_linear(x, w), x, w64, False)  # float32 throughout: no activation rounding
    ids = torch.tensor([8, 1])
    assert torch.equal(gguf_embedding_lookup(ids, w, torch.float32).double(), w64[ids])


def test_small_m_kernel_per_isa() -> None:
    """Which kernel runs: on a CPU with AVX-512 VNNI the int16 path for the types it covers and
    the AVX-512 float path for the rest; with AVX2 the AVX2 float path; generic: scalar."""
    flags = _cpu_flags()
    if "avx2" not in flags:
        pytest.skip("no AVX2 on this CPU")
    isa.set_cpu_isa(None)
    ops = build.gguf_linear_ops()
    assert ops is not None
    kernels = dict(zip(ops.type_names(), ops.small_m_kernels()))
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        for t in ("Q4_K", "Q6_K"):
            assert kernels[t] == "int16 avx512_vnni", kernels
        assert kernels["F16"] == "float avx512", kernels
    else:
        assert all(v == "float avx2" for v in kernels.values()), kernels
    isa.set_cpu_isa("generic")
    generic = build.gguf_linear_ops()
    isa.set_cpu_isa(None)
    assert generic is not None and set(generic.small_m_kernels()) == {"float generic"}


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        line = next((ln for ln in f if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


# Compiled for AVX2 + FMA + F16C only (no AVX-512): the build of an AVX2-only CPU, which this
# machine may not be. Every type's small-M kernel against its own decoder in double precision.
_AVX2_HARNESS = r"""
#include <cmath>
#include <cstdio>
#include <vector>
#include "gguf_matmul.h"
using namespace pagedllm::gguf;
int main() {
  uint32_t seed = 1;
  auto next = [&]() { seed = seed * 1664525u + 1013904223u; return seed >> 8; };
  int bad = 0;
  for (int t = 0; t < int(Type::kCount); ++t) {
    const Geometry g = kGeometry[t];
    const int64_t K = g.elems == 1 ? 300 : g.elems * (g.elems == 32 ? 9 : 2), N = 5, M = 3;
    const int64_t rb = K / g.elems * g.bytes;
    std::vector<uint8_t> w(N * rb);
    for (auto& b : w) b = uint8_t(next());
    for (int64_t i = 0; i < N * K / g.elems; ++i) {  // moderate scales: fp16 0x2000-0x3bff
      uint8_t* blk = w.data() + i * g.bytes;
      const uint16_t h = uint16_t(0x2000 + next() % 0x1c00);
      const int off = t == int(Type::Q2_K) ? 80 : t == int(Type::Q3_K) ? 108 : t == int(Type::Q6_K) ? 208 : 0;
      const bool two = t == int(Type::Q2_K) || t == int(Type::Q4_K) || t == int(Type::Q5_K) ||
                       t == int(Type::Q4_1) || t == int(Type::Q5_1);  // a second fp16 (min) field
      if (t == int(Type::MXFP4)) {
        blk[0] = uint8_t(120 + next() % 12);
      } else {
        std::memcpy(blk + off, &h, 2);
        if (two) std::memcpy(blk + off + 2, &h, 2);
      }
    }
    std::vector<float> x(M * K), y(M * N), row(K);
    for (auto& v : x) v = float(int(next() % 2001) - 1000) / 500.f;
    with_type(Type(t), [&](auto tag) {
      constexpr Type T = decltype(tag)::value;
      matmul_small<T>(x.data(), M, K, w.data(), rb, N, y.data(), "");
      for (int64_t n = 0; n < N; ++n) {
        decode_elements<T>(w.data() + n * rb, 0, K, row.data());
        for (int64_t m = 0; m < M; ++m) {
          double ref = 0, mag = 0;
          for (int64_t k = 0; k < K; ++k) {
            ref += double(x[m * K + k]) * row[k];
            mag += std::fabs(double(x[m * K + k]) * row[k]);
          }
          if (!(std::fabs(y[m * N + n] - ref) <= 1e-5 * mag + 1e-30)) {
            ++bad;
            std::printf("%s m=%ld n=%ld\n", kTypeNames[t], long(m), long(n));
          }
        }
      }
    });
  }
  std::printf("%s %s\n", bad ? "FAIL" : "OK", float_dot_variant());
  return bad != 0;
}
"""


def test_avx2_only_build_compiles_and_agrees(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import shutil
    import subprocess

    if not {"avx2", "fma", "f16c"} <= _cpu_flags():
        pytest.skip("no AVX2/FMA/F16C on this CPU")
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "harness.cpp"
    src.write_text(_AVX2_HARNESS)
    exe = tmp_path / "harness"
    flags = ["-O2", "-std=c++17", "-march=x86-64", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
    built = subprocess.run([cxx, *flags, f"-I{build.CSRC}", str(src), "-o", str(exe)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and ran.stdout.strip().endswith("OK avx2"), ran.stdout[-2000:]


@pytest.mark.parametrize("type_name", KEPT_GGUF_TYPES)
def test_bf16_panels_round_the_decoded_rows_to_nearest_even(ops, type_name: str) -> None:  # type: ignore[no-untyped-def]
    # A prefill's bf16 panel is the float32 decode rounded as torch rounds float32 -> bf16.
    idx = list(ops.type_names()).index(type_name)
    for k in _k_values(type_name):
        w = random_blocks(type_name, 9, k, seed=k + 3)
        f32 = torch.empty(5, k)
        ops.dequantize_rows(w.data, idx, 3, f32)
        panel = torch.full((5, k), float("nan"), dtype=torch.bfloat16)
        ops.dequantize_rows_bf16(w.data, idx, 3, panel)
        assert torch.equal(panel, f32.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="out of"):
        ops.dequantize_rows_bf16(w.data, idx, 5, panel)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "Q4_1", "IQ4_XS", "MXFP4"])
def test_bf16_panel_linear_is_a_bf16_matmul(ops, type_name: str) -> None:  # type: ignore[no-untyped-def]
    """From bf16_min_rows rows up (past the small-M kernel) gguf_linear multiplies x rounded to
    bf16 with the rows rounded to bf16 (float32 accumulation), its output rounded to bf16 once:
    against float64 math over the rounded operands, at most half a bf16 step of the output plus
    float32 summation. Below bf16_min_rows it is the float32 path, bit for bit."""
    k = 512
    w = random_blocks(type_name, 37, k, seed=5)
    w_b = gguf_py_dequantize(w).float().to(torch.bfloat16).double()
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(40, k, generator=gen)
    y = gguf_linear(x, w, bf16_min_rows=24)
    ref = x.to(torch.bfloat16).double() @ w_b.T
    bound = 2.0**-8 * ref.abs() + 1e-5 * (x.double().abs() @ w_b.abs().T) + 1e-30
    assert bool(((y.double() - ref).abs() <= bound).all())
    assert not torch.equal(y, gguf_linear(x, w))  # not the float32 path
    small = x[:20]  # 20 rows < 24: float32
    assert torch.equal(gguf_linear(small, w, bf16_min_rows=24), gguf_linear(small, w))
