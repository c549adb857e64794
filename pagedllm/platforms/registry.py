"""The platforms by device name, and the resolution of "auto"."""

from __future__ import annotations

from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.cuda import CudaPlatform
from pagedllm.platforms.host import device_type
from pagedllm.platforms.interface import Platform

PLATFORMS: dict[str, Platform] = {p.device_type: p for p in (CpuPlatform(), CudaPlatform())}
DEVICE_CHOICES = ("auto", *PLATFORMS)


def resolve_device(requested: str) -> str:
    """"auto" as the best available device (cuda where one is visible, else cpu), a named
    one as itself; ValueError for an unknown name or an unavailable device."""
    if requested not in DEVICE_CHOICES:
        raise ValueError(f"device={requested!r} is not one of {', '.join(map(repr, DEVICE_CHOICES))}")
    if requested == "auto":
        return "cuda" if CudaPlatform.is_available() else "cpu"
    if requested == "cuda" and not CudaPlatform.is_available():
        raise ValueError(f"device='cuda', but {CudaPlatform.unavailable_reason()}; use device='cpu'")
    return requested


def get_platform(device: str) -> Platform:
    """The platform of a resolved device ("cpu", "cuda")."""
    return PLATFORMS[device]


def platform_of(tensor_device: object) -> Platform:
    """The platform of a ``torch.device`` (or its name, "cuda:1" included)."""
    return PLATFORMS[device_type(tensor_device)]

