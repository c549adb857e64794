"""A start never compiles what is already built: a fresh process loads a finished build as it is,
whichever `ninja` its PATH finds first (ninja 1.11 and 1.13 read each other's build log as
"command line changed" and would recompile every object)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagedllm.kernels import build

REPO = Path(__file__).resolve().parents[2]


def _ninja_dirs() -> list[str]:
    """The distinct directories holding a `ninja` here: the `ninja` wheel's and PATH's."""
    found = []
    try:
        import ninja

        found.append(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    on_path = shutil.which("ninja")
    if on_path is not None:
        found.append(os.path.dirname(on_path))
    return list(dict.fromkeys(os.path.realpath(d) for d in found))


@pytest.mark.slow
def test_a_fresh_process_loads_a_finished_build_without_recompiling() -> None:
    module = build.layer_ops()  # builds here if no process has yet
    if module is None:
        pytest.skip("the compiled layer ops are unavailable (no compiler)")
    path = os.path.dirname(module.__file__)
    assert os.path.exists(os.path.join(path, build.BUILT_STAMP))
    outputs = glob.glob(os.path.join(path, "*.o")) + glob.glob(os.path.join(path, "*.so"))
    assert len(outputs) == 2, outputs
    before = {f: os.stat(f).st_mtime_ns for f in outputs}
    # The fresh process does not even import torch's build machinery (nor run ninja).
    code = (
        "import sys\nfrom pagedllm.kernels import build\nprint(build.layer_ops().__file__)\n"
        "assert 'torch.utils.cpp_extension' not in sys.modules\n"
    )
    # Each ninja here first on PATH in turn: with two versions, one of them is not the builder's.
    for ninja_dir in _ninja_dirs() or [""]:
        env = dict(os.environ, PYTHONPATH=str(REPO), PATH=ninja_dir + os.pathsep + os.environ.get("PATH", ""))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[-1] == module.__file__
    assert {f: os.stat(f).st_mtime_ns for f in outputs} == before


def test_the_compiler_is_asked_once_per_binary_and_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A build key needs the compiler's banner and ISA macros (two compiler runs); a later
    process reads them from the kernel cache, and a changed compiler binary is asked again."""
    from pagedllm.kernels import isa

    if isa.shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("PAGEDLLM_KERNEL_CACHE_DIR", str(tmp_path))
    isa.compiler_info.cache_clear()
    first = isa.compiler_info("avx2")
    assert first.version and (tmp_path / "compilers.json").is_file()
    runs: list[list[str]] = []
    real_run = isa.subprocess.run
    monkeypatch.setattr(isa.subprocess, "run", lambda cmd, **kw: runs.append(cmd) or real_run(cmd, **kw))
    isa.compiler_info.cache_clear()  # as a fresh process
    assert isa.compiler_info("avx2") == first and runs == []
    isa.compiler_info.cache_clear()
    assert isa.compiler_info("generic").version and len(runs) == 2  # other flags: asked
    # Another binary at the same path (an upgraded compiler): asked again.
    assert first.path is not None
    real_stat = os.stat
    newer = SimpleNamespace(st_size=real_stat(first.path).st_size, st_mtime_ns=real_stat(first.path).st_mtime_ns + 1)
    monkeypatch.setattr(isa.os, "stat", lambda p, *a, **k: newer if p == first.path else real_stat(p, *a, **k))
    isa.compiler_info.cache_clear()
    assert isa.compiler_info("avx2") == first and len(runs) == 4
    isa.compiler_info.cache_clear()
