"""malloc_policy.keep_freed_memory: freed large blocks stay in the process for reuse (no page
faults when the next step allocates the same sizes), unless the user set glibc's tunables."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from pagedllm.malloc_policy import user_set_malloc

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc",
                                reason="mallopt is glibc's")

# Allocate, touch and free a 64 MB tensor (above glibc's largest mmap threshold, 32 MB) eight
# times, as steps allocate their activations; print whether the policy applied and the minor
# page faults of the last three rounds. With the policy the heap grows by a few such blocks
# (a freed block is not always the one the next allocation takes) and then reuses them.
_PROBE = """
import resource, torch
from pagedllm.malloc_policy import keep_freed_memory
applied = keep_freed_memory()
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(16 * 1024 * 1024)  # 64 MB of float32
    t.fill_(1.0)
    del t
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, sum(faults[-3:]))
"""


def _probe(extra_env: dict[str, str]) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env.update(extra_env)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


def test_freed_memory_is_reused_without_faults() -> None:
    applied, faults = _probe({})
    assert applied
    assert faults < 1000  # 64 MB is 16,384 pages of 4 KB: none faulted in again


def test_the_users_settings_stand() -> None:
    applied, faults = _probe({"MALLOC_MMAP_THRESHOLD_": "131072"})
    assert not applied
    assert faults > 3 * 16_000  # the control: glibc maps each block afresh and faults every page in


def test_user_settings_are_detected() -> None:
    assert not user_set_malloc({})
    assert user_set_malloc({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert user_set_malloc({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0"})
    assert not user_set_malloc({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"})
