"""Which instruction-set level the compiled kernels target, and how to compile for it.

The ladder (generic, avx2, avx512, amx) and its detection from the CPU's flags are the CPU
platform's (platforms/isa.py). Each level compiles with explicit -m flags (`LEVEL_FLAGS`),
never -march=native, so a build is exactly what its level names and runs on any CPU that
has that level; -mtune=native only schedules. The level in use is the engine's
``DeviceConfig.cpu_isa`` (`set_cpu_isa`, called by the engine's builder), else
`PAGEDLLM_CPU_ISA` (read at first use), else the CPU's highest; never above what the CPU runs.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from pagedllm.platforms.isa import ISAS, Isa, is_x86_64, detect_cpu_isa, isa_at_least, resolve_isa

logger = logging.getLogger(__name__)

__all__ = ["ISAS", "Isa", "LEVEL_FLAGS", "cpu_isa", "detect_cpu_isa", "isa_at_least", "isa_cflags",
           "resolve_isa", "set_cpu_isa", "compiler_info", "CompilerInfo"]

_AVX2 = ("-mavx2", "-mfma", "-mf16c", "-mbmi2")
_AVX512 = _AVX2 + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx512bf16",
                   "-mavx512vbmi")
_AMX = _AVX512 + ("-mamx-tile", "-mamx-int8", "-mamx-bf16")
LEVEL_FLAGS: dict[Isa, tuple[str, ...]] = {"generic": (), "avx2": _AVX2, "avx512": _AVX512, "amx": _AMX}
"""The instruction-set flags of each level on top of baseline x86-64 (each contains the one
below, as platforms/isa.py's REQUIRED_FLAGS do)."""

# Predefined macros that name an instruction-set extension the compiler may emit.
_ISA_MACRO = re.compile(
    r"^#define (__(?:MMX|SSE|SSSE|AVX|FMA|F16C|BMI|POPCNT|LZCNT|AES|PCLMUL|SHA|VAES|VPCLMULQDQ|GFNI|AMX|ADX"
    r"|MOVBE|XSAVE|RDRND|RDSEED|ARM_NEON|ARM_FEATURE_)\w*) ",
    re.M,
)

_selected: Isa | None = None


def cpu_isa() -> Isa:
    """The level kernels are built and dispatched for (`set_cpu_isa`'s, else
    PAGEDLLM_CPU_ISA, else the CPU's). Called on every kernel lookup: one global read once
    resolved."""
    global _selected
    if _selected is None:
        _selected = resolve_isa(os.environ.get("PAGEDLLM_CPU_ISA"))
    return _selected


def set_cpu_isa(isa: str | None) -> Isa:
    """Select the level of later kernel lookups (None: PAGEDLLM_CPU_ISA, else the CPU's);
    returns the one in effect (a level the CPU lacks falls to its highest, with a warning).
    Extensions already loaded for another level stay loaded."""
    global _selected
    _selected = resolve_isa(isa) if isa is not None else None
    return cpu_isa()


def isa_cflags(isa: Isa) -> list[str]:
    """The compile flags of a build for `isa`."""
    if not is_x86_64():
        return ["-O3", "-fopenmp"]
    if isa == "generic":
        return ["-O3", "-fopenmp", "-march=x86-64", "-mtune=generic"]
    return ["-O3", "-fopenmp", "-march=x86-64", *LEVEL_FLAGS[isa], "-mtune=native"]


@dataclass(frozen=True)
class CompilerInfo:
    path: str | None
    """the C++ compiler torch's build runs ($CXX, else c++), resolved; None if missing"""
    version: str
    """its `--version` banner's first line"""
    isa_macros: tuple[str, ...]
    """the instruction-set macros it defines under the ISA's flags (e.g. __AVX2__, __FMA__)"""


def kernel_cache_root() -> str:
    """Where compiled kernels are cached ($PAGEDLLM_KERNEL_CACHE_DIR, else
    $PAGEDLLM_CACHE_DIR/torch_extensions, default ~/.cache/pagedllm/torch_extensions)."""
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.expanduser("~/.cache/pagedllm")
    return os.environ.get("PAGEDLLM_KERNEL_CACHE_DIR") or os.path.join(root, "torch_extensions")


# What a compiler said, by its binary (path, size, mtime) and flags, under kernel_cache_root():
# asking it costs two compiler runs (0.1 s, more on a loaded machine) at every start.
_COMPILERS_FILE = "compilers.json"


@functools.cache
def compiler_info(isa: Isa) -> CompilerInfo:
    """The compiler and what it targets under `isa`'s flags (part of every build key); read
    from the kernel cache when this binary was asked with these flags before."""
    found = shutil.which(os.environ.get("CXX", "c++"))
    if found is None:
        return CompilerInfo(None, "", ())
    path = os.path.realpath(found)
    flags = [f for f in isa_cflags(isa) if f != "-fopenmp"]
    try:
        st = os.stat(path)
    except OSError:
        return CompilerInfo(path, "", ())
    key = "\0".join([path, str(st.st_size), str(st.st_mtime_ns), *flags])
    known = _read_compilers()
    if key in known:
        version, macros = known[key]
        return CompilerInfo(path, version, tuple(macros))
    info = _ask_compiler(path, flags)
    if info.version:  # a compiler that answered: keep what it said
        _write_compilers({**_read_compilers(), key: [info.version, list(info.isa_macros)]})
    return info


def _ask_compiler(path: str, flags: list[str]) -> CompilerInfo:
    try:
        banner = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
        macros = subprocess.run(
            [path, *flags, "-dM", "-E", "-x", "c++", os.devnull], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return CompilerInfo(path, "", ())
    version = banner.splitlines()[0] if banner else ""
    return CompilerInfo(path, version, tuple(sorted(set(_ISA_MACRO.findall(macros)))))


def _read_compilers() -> dict[str, list]:
    try:
        with open(os.path.join(kernel_cache_root(), _COMPILERS_FILE)) as f:
            known = json.load(f)
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _write_compilers(known: dict[str, list]) -> None:
    """Replace the file whole (a reader never sees half of it); a read-only cache: skip."""
    root = kernel_cache_root()
    tmp = os.path.join(root, f"{_COMPILERS_FILE}.tmp.{os.getpid()}")
    try:
        os.makedirs(root, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(known, f, indent=1, sort_keys=True)
        os.replace(tmp, os.path.join(root, _COMPILERS_FILE))
    except OSError:
        pass
