"""The build key and the ISA ladder: each level compiles with exactly its flags, a build for
one level, compiler or torch never loads as another's; a level the CPU lacks falls to its
highest; the AVX2-only headers refuse to compile without AVX2; a build per level loads and
runs where the CPU has it; PAGEDLLM_CPU_ISA is honoured by a fresh process's dispatch."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm import kernels
from pagedllm.kernels import build, isa
from pagedllm.platforms.isa import level_of_flags

REPO = Path(__file__).resolve().parents[2]


def test_resolve_isa_falls_to_the_highest_level_the_cpu_has(caplog: pytest.LogCaptureFixture) -> None:
    assert isa.resolve_isa(None, detected="avx512") == "avx512" and isa.resolve_isa("", detected="avx2") == "avx2"
    assert isa.resolve_isa("generic", detected="avx512") == "generic"
    assert isa.resolve_isa("avx2", detected="amx") == "avx2"
    with caplog.at_level(logging.WARNING, logger="pagedllm.platforms.isa"):
        assert isa.resolve_isa("amx", detected="avx512") == "avx512"  # would die on SIGILL
        assert isa.resolve_isa("avx512", detected="avx2") == "avx2"
        assert isa.resolve_isa("avx2", detected="generic") == "generic"
    assert caplog.text.count("using ") == 3
    with pytest.raises(ValueError, match="'sse9' is not one of generic, avx2, avx512, amx"):
        isa.resolve_isa("sse9")


def test_levels_from_cpu_flags() -> None:
    avx2 = {"avx", "avx2", "fma", "f16c", "bmi2"}
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi", "avx512_vnni", "avx512_bf16"}
    assert level_of_flags(set()) == "generic"
    assert level_of_flags(avx2 - {"f16c"}) == "generic"
    assert level_of_flags(avx2) == "avx2"
    assert level_of_flags(avx512 - {"avx512_bf16"}) == "avx2"  # Ice Lake: VNNI without BF16
    assert level_of_flags(avx512) == "avx512"
    assert level_of_flags(avx512 | {"amx_tile", "amx_int8"}) == "avx512"
    assert level_of_flags(avx512 | {"amx_tile", "amx_int8", "amx_bf16"}) == "amx"
    assert level_of_flags({"amx_tile", "amx_int8", "amx_bf16"}) == "generic"  # a level needs the ones below


def test_native_level_is_the_cpus() -> None:
    flags = set(Path("/proc/cpuinfo").read_text().partition("flags")[2].partition("\n")[0].split())
    has = lambda *names: set(names) <= flags  # noqa: E731
    expected = "generic"
    if has("avx2", "fma", "f16c", "bmi2"):
        expected = "avx2"
        if has("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi", "avx512_vnni", "avx512_bf16"):
            expected = "avx512"
            if has("amx_tile", "amx_int8", "amx_bf16"):
                expected = "amx"
    assert kernels.detect_cpu_isa() == expected


def test_each_level_compiles_exactly_its_extensions() -> None:
    for level in isa.ISAS:
        assert "-march=native" not in isa.isa_cflags(level)
    generic = isa.isa_cflags("generic")
    assert "-mavx2" not in generic and "-mtune=generic" in generic
    assert [f for f in isa.isa_cflags("avx2") if f.startswith("-m") and f != "-mtune=native"] == [
        "-march=x86-64", "-mavx2", "-mfma", "-mf16c", "-mbmi2"]
    macros = {level: set(isa.compiler_info(level).isa_macros) for level in isa.ISAS}
    assert not {"__AVX2__", "__FMA__", "__AVX__"} & macros["generic"]
    assert {"__AVX2__", "__FMA__", "__F16C__", "__BMI2__"} <= macros["avx2"]
    assert not any(m.startswith("__AVX512") for m in macros["avx2"])  # what -march=native leaked before
    assert {"__AVX512F__", "__AVX512BW__", "__AVX512VL__", "__AVX512VNNI__", "__AVX512BF16__"} <= macros["avx512"]
    assert not any(m.startswith("__AMX") for m in macros["avx512"])
    assert {"__AMX_TILE__", "__AMX_INT8__", "__AMX_BF16__"} <= macros["amx"]
    for lower, higher in zip(isa.ISAS, isa.ISAS[1:]):
        assert macros[lower] <= macros[higher], (lower, higher)


def test_build_key_names_isa_compiler_and_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import torch

    monkeypatch.setenv("PAGEDLLM_KERNEL_CACHE_DIR", str(tmp_path))  # build_dir makes directories

    ext = build.EXTENSIONS["layer_ops"]
    key = build.build_key(ext, "generic")
    cc = isa.compiler_info("generic")
    assert key["isa"] == "generic" and key["cflags"] == isa.isa_cflags("generic")
    assert key["isa_macros"] == cc.isa_macros and key["compiler"] == cc.path and cc.version
    assert key["compiler_version"] == cc.version and key["torch"] == torch.__version__
    assert set(key["sources"]) == set(ext.sources)
    generic_dir = build.build_dir(ext, "generic")
    assert os.path.basename(generic_dir).startswith("generic-")
    assert json.loads(Path(generic_dir, "build_key.json").read_text()) == json.loads(json.dumps(key))
    assert len({generic_dir, *(build.build_dir(ext, level) for level in ("avx2", "avx512", "amx"))}) == 4
    # Another torch or another compiler: another directory.
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    other_torch = build.build_dir(ext, "generic")
    monkeypatch.setattr(isa, "compiler_info", lambda _: isa.CompilerInfo("/opt/other/c++", "c++ 99", cc.isa_macros))
    monkeypatch.setattr(build, "compiler_info", isa.compiler_info)
    other_compiler = build.build_dir(ext, "generic")
    assert len({generic_dir, other_torch, other_compiler}) == 3


@pytest.mark.parametrize("header", ["gemm_tiles.h", "quant_linear.h"])
def test_avx2_only_headers_refuse_baseline_x86_64(header: str) -> None:
    cxx = isa.compiler_info("generic").path
    assert cxx is not None
    src = build.CSRC / header
    base = [cxx, "-fsyntax-only", "-fopenmp", "-x", "c++", str(src)]
    generic = subprocess.run(base[:1] + isa.isa_cflags("generic") + base[1:], capture_output=True, text=True)
    assert generic.returncode != 0 and f"{header} needs AVX2 and FMA" in generic.stderr
    if kernels.isa_at_least(kernels.detect_cpu_isa(), "avx2"):
        native = subprocess.run(base[:1] + ["-mavx2", "-mfma"] + base[1:], capture_output=True, text=True)
        assert native.returncode == 0, native.stderr


@pytest.mark.slow
def test_env_override_selects_generic_builds_in_a_fresh_process(tmp_path: Path) -> None:
    code = (
        "from pagedllm import kernels\n"
        "assert kernels.cpu_isa() == 'generic'\n"
        "import json, os\n"
        "found = {n: (m.__file__ if m else None) for n in kernels.EXTENSIONS for m in [kernels.extension(n)]}\n"
        "print(json.dumps(found))\n"
    )
    env = dict(os.environ, PAGEDLLM_CPU_ISA="generic", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.splitlines()[-1])
    for name, path in found.items():
        if build.EXTENSIONS[name].min_isa != "generic":
            assert path is None, name
        else:
            parent = os.path.basename(os.path.dirname(path))
            assert parent.startswith("generic-") and path.endswith(f"pagedllm_{name}_generic.so"), path


@pytest.mark.slow
@pytest.mark.parametrize("level", isa.ISAS)
def test_a_build_per_level_loads_and_runs_where_the_cpu_has_it(level: str) -> None:
    """layer_ops (scalar code under generic) built for ``level``: the module loaded is that
    level's build, its recorded flags are the level's, and it computes RMSNorm as torch."""
    import torch

    if not kernels.isa_at_least(kernels.detect_cpu_isa(), level):  # type: ignore[arg-type]
        pytest.skip(f"this CPU runs up to {kernels.detect_cpu_isa()}, not {level}")
    previous = kernels.cpu_isa()
    try:
        assert kernels.set_cpu_isa(level) == level
        module = kernels.layer_ops()
        assert module is not None, f"layer_ops did not build for {level}"
        assert module.__name__ == f"pagedllm_layer_ops_{level}"
        record = json.loads(Path(os.path.dirname(module.__file__), "build_key.json").read_text())
        assert record["isa"] == level and record["cflags"] == isa.isa_cflags(level)  # type: ignore[arg-type]
        x = torch.randn(5, 64, dtype=torch.float64).float()
        weight = torch.rand(64) + 0.5
        ref = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()).float()
        torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-6), ref, rtol=1e-5, atol=1e-5)
    finally:
        kernels.set_cpu_isa(previous)
