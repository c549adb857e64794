"""The build key and the ISA selection: a build for one ISA, compiler or torch never loads as
another's; the AVX2-only headers refuse to compile without AVX2; PAGEDLLM_CPU_ISA is honoured
by a fresh process's dispatch and build directories."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm import kernels
from pagedllm.kernels import build, isa

REPO = Path(__file__).resolve().parents[2]


def test_resolve_isa_honours_the_override_but_never_above_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isa, "detect_cpu_isa", lambda: "avx2")
    assert isa.resolve_isa(None) == "avx2" and isa.resolve_isa("") == "avx2"
    assert isa.resolve_isa("generic") == "generic"
    monkeypatch.setattr(isa, "detect_cpu_isa", lambda: "generic")
    assert isa.resolve_isa("avx2") == "generic"  # would die on SIGILL
    with pytest.raises(ValueError, match="'sse9' is not one of generic, avx2"):
        isa.resolve_isa("sse9")


def test_generic_flags_target_baseline_x86_64() -> None:
    assert "-march=native" in isa.isa_cflags("avx2")
    generic = isa.isa_cflags("generic")
    assert "-march=native" not in generic and "-mavx2" not in generic
    macros = isa.compiler_info("generic").isa_macros
    assert "__AVX2__" not in macros and "__FMA__" not in macros and "__AVX__" not in macros
    if kernels.detect_cpu_isa() == "avx2":
        assert {"__AVX2__", "__FMA__"} <= set(isa.compiler_info("avx2").isa_macros)


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
    assert build.build_dir(ext, "avx2") != generic_dir
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
    if kernels.detect_cpu_isa() == "avx2":
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
        if build.EXTENSIONS[name].needs_avx2:
            assert path is None, name
        else:
            parent = os.path.basename(os.path.dirname(path))
            assert parent.startswith("generic-") and path.endswith(f"pagedllm_{name}_generic.so"), path
