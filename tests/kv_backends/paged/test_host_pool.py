"""The paged KV pool's host memory (kv_backends/paged/worker.py, host_zeros): zeros, writable,
alive as long as a view of it, and in small pages (no transparent-huge-page advice, whose
first writes wait for memory compaction)."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from pagedllm.kv_backends.paged.worker import host_zeros


def _vm_flags(address: int) -> list[str]:
    """VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_pool_is_zeroed_writable_and_outlives_its_name() -> None:
    pool = host_zeros(3 << 20)
    assert pool.dtype == torch.uint8 and pool.numel() == 3 << 20
    assert int(pool.count_nonzero()) == 0
    view = pool[1 << 20 :].view(torch.float32)
    del pool
    gc.collect()
    view[7] = 2.5  # the mapping is still there
    assert float(view[7]) == 2.5 and int(view.count_nonzero()) == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_pool_asks_for_small_pages() -> None:
    pool = host_zeros(8 << 20)
    flags = _vm_flags(pool.data_ptr())
    assert "nh" in flags and "hg" not in flags, flags
