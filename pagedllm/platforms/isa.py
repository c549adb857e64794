"""The CPU's instruction-set ladder: each level a strict superset of the one below, detected
at run time from the CPU's flags (/proc/cpuinfo). No torch, no compiler here: the compile
flags of each level live with the kernels (kernels/isa.py).

- "generic": anything (baseline x86-64, or another architecture): scalar kernels only.
- "avx2": AVX2 + FMA + F16C + BMI2 (Haswell, Zen 1 on).
- "avx512": that + AVX-512 F/BW/VL/DQ/VBMI with VNNI and BF16 (Cooper Lake, Sapphire Rapids,
  Zen 4 on).
- "amx": that + AMX tiles with int8 and bf16 (Sapphire Rapids on).
"""

from __future__ import annotations

import functools
import logging
import platform
from typing import Literal, cast

logger = logging.getLogger(__name__)

Isa = Literal["generic", "avx2", "avx512", "amx"]
ISAS: tuple[Isa, ...] = ("generic", "avx2", "avx512", "amx")
"""Lowest first: a level runs everything the levels below it run."""

REQUIRED_FLAGS: dict[Isa, frozenset[str]] = {
    "generic": frozenset(),
    "avx2": frozenset({"avx2", "fma", "f16c", "bmi2"}),
    "avx512": frozenset({"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                         "avx512vbmi", "avx512_vnni", "avx512_bf16"}),
    "amx": frozenset({"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                      "avx512vbmi", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}),
}
"""The /proc/cpuinfo flags a level needs (Linux's names), each set containing the one below."""


def isa_rank(isa: Isa) -> int:
    """The level's place on the ladder (generic 0)."""
    return ISAS.index(isa)


def isa_at_least(isa: Isa, minimum: Isa) -> bool:
    """Whether code for `minimum` runs at level `isa`."""
    return isa_rank(isa) >= isa_rank(minimum)


def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def level_of_flags(flags: frozenset[str] | set[str]) -> Isa:
    """The highest level whose flags are all in `flags`."""
    best: Isa = "generic"
    for isa in ISAS:
        if REQUIRED_FLAGS[isa] <= flags:
            best = isa
    return best


def read_cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first processor's flags line, as a set (empty where unreadable)."""
    try:
        with open(path) as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


@functools.cache
def detect_cpu_isa() -> Isa:
    """The highest level this CPU runs (generic off x86-64)."""
    if not is_x86_64():
        return "generic"
    return level_of_flags(read_cpu_flags())


def resolve_isa(requested: str | None, detected: Isa | None = None) -> Isa:
    """`requested` (a level, or None/"" for the CPU's) as this CPU can run it: a level above
    the CPU's falls to the CPU's highest, with a warning; ValueError for an unknown name."""
    detected = detect_cpu_isa() if detected is None else detected
    if not requested:
        return detected
    if requested not in ISAS:
        raise ValueError(f"cpu_isa={requested!r} is not one of {', '.join(ISAS)}")
    if not isa_at_least(detected, cast(Isa, requested)):
        missing = sorted(REQUIRED_FLAGS[cast(Isa, requested)] - read_cpu_flags()) if is_x86_64() else []
        logger.warning("cpu_isa=%s but this CPU lacks %s: using %s, its highest level",
                       requested, ", ".join(missing) or "it", detected)
        return detected
    return cast(Isa, requested)
