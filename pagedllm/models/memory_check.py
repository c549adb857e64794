"""Will the model fit? Weights plus the smallest KV pool against the memory available, checked
before any weight is read, so an oversized model is a clear error and never an OOM kill.

The memory available is the kernel's MemAvailable (/proc/meminfo), lowered to what a cgroup
memory limit leaves (v2: memory.max - memory.current; v1: memory.limit_in_bytes -
memory.usage_in_bytes) when one is set. A GGUF file's pages in the page cache are not counted
against it: they are reclaimable, and the kept weights are copies in anonymous memory.
"""

from __future__ import annotations

from typing import NamedTuple

from pagedllm.models.family import ArchConfig

_CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)
_KV_BLOCK = 16
GiB = 1 << 30


class AvailableMemory(NamedTuple):
    mem_available: int | None
    """MemAvailable in bytes (None where /proc/meminfo is not readable)."""
    cgroup_left: int | None
    """The cgroup's limit minus its usage (None: no limit set)."""

    @property
    def bytes(self) -> int | None:
        known = [v for v in (self.mem_available, self.cgroup_left) if v is not None]
        return min(known) if known else None

    def describe(self) -> str:
        parts = [f"MemAvailable {_gib(self.mem_available)}" if self.mem_available is not None else "MemAvailable unknown"]
        if self.cgroup_left is not None:
            parts.append(f"cgroup limit leaves {_gib(self.cgroup_left)}")
        return ", ".join(parts)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def available_memory() -> AvailableMemory:
    """What this process may still allocate (module docstring)."""
    mem_available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    mem_available = int(line.split()[1]) * 1024
    except OSError:
        pass
    cgroup_left = None
    for limit_file, usage_file in _CGROUP_FILES:
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < 1 << 60:  # v1 "unlimited" is ~2^63
            cgroup_left = max(0, limit - usage)
            break
    return AvailableMemory(mem_available, cgroup_left)


def smallest_kv_pool_bytes(arch: ArchConfig, max_model_len: int, dtype_bytes: int) -> int:
    """Bytes of a KV pool that holds one sequence of max_model_len tokens (K and V, every
    layer, in blocks of 16): the least any engine for this model allocates to serve it."""
    tokens = -(-max_model_len // _KV_BLOCK) * _KV_BLOCK
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * dtype_bytes * tokens


def check_memory_fits(model: str, weight_bytes: int, kv_bytes: int) -> None:
    """ValueError naming the sizes and what to change when weights + KV pool exceed the memory
    available; nothing when they fit or the memory available is unknown."""
    available = available_memory()
    if available.bytes is None or weight_bytes + kv_bytes <= available.bytes:
        return
    if kv_bytes >= weight_bytes:  # the context length is what does not fit: say that first
        advice = "pass a smaller --max-model-len (the KV pool must hold one sequence of it), or free memory"
    else:
        advice = "use a smaller quant of the model, a smaller --max-model-len, or free memory"
    raise ValueError(
        f"{model} does not fit in memory: its weights take {_gib(weight_bytes)} and the smallest KV "
        f"pool (one sequence of the model's length) {_gib(kv_bytes)}, but only {_gib(available.bytes)} "
        f"is available ({available.describe()}); {advice}"
    )


def _gib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / GiB:.2f} GiB"
