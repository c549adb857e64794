"""Which instruction set the compiled kernels target, and how to compile for it.

- "avx2": x86-64 with AVX2 and FMA; builds with -march=native (every extension).
- "generic": anything else; builds for baseline x86-64 (or the compiler's default target
  elsewhere) without AVX2 intrinsics: the extensions with scalar code only (build.py).

Detected from the CPU (/proc/cpuinfo flags avx2 and fma); `PAGEDLLM_CPU_ISA` (read at first
use) or `set_cpu_isa()` selects one, never above what the CPU runs.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Literal, cast

logger = logging.getLogger(__name__)

Isa = Literal["generic", "avx2"]
ISAS: tuple[Isa, ...] = ("generic", "avx2")

# Predefined macros that name an instruction-set extension the compiler may emit.
_ISA_MACRO = re.compile(
    r"^#define (__(?:MMX|SSE|SSSE|AVX|FMA|F16C|BMI|POPCNT|LZCNT|AES|PCLMUL|SHA|VAES|VPCLMULQDQ|GFNI|AMX|ADX"
    r"|MOVBE|XSAVE|RDRND|RDSEED|ARM_NEON|ARM_FEATURE_)\w*) ",
    re.M,
)

_selected: Isa | None = None


def _x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def detect_cpu_isa() -> Isa:
    """The best ISA this CPU runs: "avx2" where /proc/cpuinfo lists avx2 and fma."""
    if not _x86_64():
        return "generic"
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return "generic"
    flags = set(line.partition(":")[2].split())
    return "avx2" if {"avx2", "fma"} <= flags else "generic"


def resolve_isa(requested: str | None) -> Isa:
    """`requested` ("generic", "avx2", or None/"" for the CPU's) as this CPU can run it."""
    detected = detect_cpu_isa()
    if not requested:
        return detected
    if requested not in ISAS:
        raise ValueError(f"PAGEDLLM_CPU_ISA={requested!r} is not one of {', '.join(ISAS)}")
    if requested == "avx2" and detected != "avx2":
        logger.warning("PAGEDLLM_CPU_ISA=avx2 but this CPU lacks AVX2/FMA: using the generic kernels")
        return "generic"
    return cast(Isa, requested)


def cpu_isa() -> Isa:
    """The ISA kernels are built and dispatched for (PAGEDLLM_CPU_ISA, else the CPU's).
    Called on every kernel lookup: one global read once resolved."""
    global _selected
    if _selected is None:
        _selected = resolve_isa(os.environ.get("PAGEDLLM_CPU_ISA"))
    return _selected


def set_cpu_isa(isa: str | None) -> Isa:
    """Select the ISA of later kernel lookups (None: PAGEDLLM_CPU_ISA, else the CPU's);
    returns the one in effect. Extensions already loaded for another ISA stay loaded."""
    global _selected
    _selected = resolve_isa(isa) if isa is not None else None
    return cpu_isa()


def isa_cflags(isa: Isa) -> list[str]:
    """The compile flags of a build for `isa`."""
    if isa == "avx2":
        return ["-O3", "-march=native", "-fopenmp"]
    return ["-O3", "-fopenmp"] + (["-march=x86-64", "-mtune=generic"] if _x86_64() else [])


@dataclass(frozen=True)
class CompilerInfo:
    path: str | None
    """the C++ compiler torch's build runs ($CXX, else c++), resolved; None if missing"""
    version: str
    """its `--version` banner's first line"""
    isa_macros: tuple[str, ...]
    """the instruction-set macros it defines under the ISA's flags (e.g. __AVX2__, __FMA__)"""


@functools.cache
def compiler_info(isa: Isa) -> CompilerInfo:
    """The compiler and what it targets under `isa`'s flags (part of every build key)."""
    found = shutil.which(os.environ.get("CXX", "c++"))
    if found is None:
        return CompilerInfo(None, "", ())
    path = os.path.realpath(found)
    try:
        banner = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
        flags = [f for f in isa_cflags(isa) if f != "-fopenmp"]
        macros = subprocess.run(
            [path, *flags, "-dM", "-E", "-x", "c++", os.devnull], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return CompilerInfo(path, "", ())
    version = banner.splitlines()[0] if banner else ""
    return CompilerInfo(path, version, tuple(sorted(set(_ISA_MACRO.findall(macros)))))
