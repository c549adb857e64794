"""Where a tensor's memory is, for kernels that dispatch per tensor: the compiled C++
kernels (kernels/csrc) read host pointers, and the Triton kernels compile for device
memory only. The kernels sit below the platform classes (cpu.py asks kernels/triton
whether Triton is interpreted), so they ask this module, which imports nothing; each
platform's ``uses_host_memory`` agrees with it (tests/test_platform_boundary.py)."""

from __future__ import annotations

HOST_DEVICE_TYPES = frozenset({"cpu"})
"""The torch device types whose tensors live in host memory."""


def device_type(device: object) -> str:
    """The type of a ``torch.device`` or of a device name ("cuda:1" -> "cuda")."""
    return getattr(device, "type", None) or str(device).split(":")[0]


def in_host_memory(device: object) -> bool:
    """Whether tensors on ``device`` (a ``torch.device`` or its name) live in host memory."""
    return device_type(device) in HOST_DEVICE_TYPES


def is_host_tensor(tensor: object) -> bool:
    """Whether ``tensor`` (a torch.Tensor) lives in host memory: ``in_host_memory`` of its
    device, read without building a ``torch.device`` (called per layer per step)."""
    return bool(tensor.is_cpu)  # type: ignore[attr-defined]  # torch's own test for "cpu"
