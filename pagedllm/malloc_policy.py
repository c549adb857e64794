"""Freed activation memory kept for reuse in the engine's process (glibc `mallopt`).

A prefill step's activations are tens of megabytes per tensor (a 4,096-token chunk's gate/up
output is [4096, 3072] float32: 50 MB). glibc serves allocations above its mmap threshold
(128 KB, raised to at most 32 MB as such blocks are freed) with a fresh `mmap` and returns
them to the kernel on free, so every step faults every page of every large tensor in again:
measured on the 2-core Xeon, one thread, widening a [4096, 3072] bf16 GEMM output to float32
took 21.3 ms of CPU time with the default and 6.3 ms with the settings below, the whole
bf16 linear 33.6 against 20.2 ms. vLLM's CPU guide has users preload tcmalloc for the same
reason; here glibc is told to keep what is freed: no mmap for allocations
(M_MMAP_MAX = 0: they come from the heap) and no trimming of the heap's top
(M_TRIM_THRESHOLD at its maximum). The process keeps its peak heap, which for the engine is
the model, the KV cache and one step's activations, all reused from step to step.

Only the engine's own process is set (`core_builder`), and only where the user has not set
glibc's malloc tunables (MALLOC_MMAP_MAX_, MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_,
or glibc.malloc.* in GLIBC_TUNABLES); other C libraries (musl, macOS) are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from typing import Mapping

logger = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_MAX = 2**31 - 1  # mallopt takes an int

_USER_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")

_applied = False


def user_set_malloc(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment sets glibc's malloc tunables itself."""
    return any(name in environ for name in _USER_SETTINGS) or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")


def keep_freed_memory(environ: Mapping[str, str] = os.environ) -> bool:
    """Make glibc keep freed memory for reuse in this process; True where it is now so (set
    here or before), False where the user's settings stand or the C library is not glibc."""
    global _applied
    if _applied:
        return True
    if user_set_malloc(environ):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, _TRIM_MAX)):
        logger.info("mallopt refused the settings; freed memory goes back to the kernel")
        return False
    _applied = True
    return True
