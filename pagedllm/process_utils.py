"""Helpers for the engine's child processes (the engine core, tensor-parallel workers)."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process when its parent dies (PR_SET_PDEATHSIG, Linux);
    exit now if the parent is already gone. Elsewhere callers keep checking ``os.getppid()``."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the caller's parent-pid check still applies
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
