"""How long OpenMP's idle threads spin before they sleep, set before torch loads libgomp.

Every compiled kernel and torch op here runs in OpenMP parallel regions (2 threads on the
target machine, a few hundred regions per decode step). A region ends only when every thread
has arrived, and libgomp's idle threads spin for GOMP_SPINCOUNT iterations (300,000 by
default: milliseconds) before sleeping. When another process takes a core, the spinning thread
holds its core while the thread the region waits for cannot run: measured on the 2-core
machine at load average ~10, a batch-1 decode step of the default model took 160-202 ms with
the default and 36-63 ms with 100-1,000 spins (3-4x), and the int4 kernels alone 640-840 ms
against 9-12 ms for 40 calls at M = 1 (docs/benchmarks.md, 2026-12-01). 1,000 is libgomp's own
count for oversubscribed threads; on a quiet machine the gaps between a decode step's regions
are microseconds, inside that window, so the threads still do not sleep within a step.

Only the default changes: an explicit GOMP_SPINCOUNT or OMP_WAIT_POLICY is left as it is, and
where torch (libgomp) is already loaded in the process, the setting has no effect there.
"""

from __future__ import annotations

import os
from typing import MutableMapping

DEFAULT_SPIN_COUNT = "1000"


def set_default_spin_count(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Sets GOMP_SPINCOUNT to DEFAULT_SPIN_COUNT unless it or OMP_WAIT_POLICY is set; True if set."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return False
    environ["GOMP_SPINCOUNT"] = DEFAULT_SPIN_COUNT
    return True
