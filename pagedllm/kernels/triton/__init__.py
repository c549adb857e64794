"""Triton kernels for the device path: paged attention (decode and prefill over a cached
context), the KV write, rotary, RMSNorm and silu-and-mul (docs/gpu.md).

Each source module (``attention.py``, ``elementwise.py``) holds its ``@triton.jit`` kernels
and the Python launchers that take torch tensors; ``triton_ops(device)`` returns the
launchers. They compile for CUDA tensors. On CPU tensors they run only under Triton's
interpreter, which is a property of the process: triton reads ``TRITON_INTERPRET`` when a
kernel is decorated, its own library functions (``tl.sum``, ``tl.max``) included, which are
decorated when triton is imported. So the variable must be set before the first ``import
triton`` (the kernel tests do so, scoped to that import); ``triton_ops("cpu")`` refuses
otherwise.

Only Triton API present in Triton 3.6 (the GPU machine's version) is used.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from pagedllm.platforms.host import in_host_memory


@functools.cache
def triton_available() -> bool:
    """Whether triton imports here (the CPU-only wheel of torch does not bring it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_interpreted() -> bool:
    """Whether this process's Triton kernels run in the interpreter (on CPU tensors)."""
    from pagedllm.kernels.triton import attention

    return attention.INTERPRETED


def triton_ops(device: torch.device | str) -> SimpleNamespace:
    """The kernels' launchers for tensors on ``device``; RuntimeError when triton is missing,
    or for CPU tensors when the process's Triton is not the interpreter."""
    if not triton_available():
        raise RuntimeError("the Triton kernels need the triton package (pip install triton)")
    ops = _load()
    if in_host_memory(device) and not ops.INTERPRETED:
        raise RuntimeError(
            "the Triton kernels run on CPU tensors only under Triton's interpreter: set "
            "TRITON_INTERPRET=1 before triton is first imported (tests do), or use device='cuda'"
        )
    return ops


@functools.cache
def _load() -> SimpleNamespace:
    from pagedllm.kernels.triton import attention, elementwise

    namespace: dict[str, object] = {"INTERPRETED": attention.INTERPRETED}
    for module in (attention, elementwise):
        namespace.update({name: getattr(module, name) for name in module.__all__})
    return SimpleNamespace(**namespace)
