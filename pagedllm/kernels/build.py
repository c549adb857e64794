"""Compiled CPU kernels (C++/OpenMP through torch.utils.cpp_extension), built on first use:
paged attention (csrc/paged_attention.cpp), weight-only quantized linears
(csrc/quant_linear.cpp, AVX2), fused elementwise layer ops (csrc/layer_ops.cpp: RMSNorm,
rotary, silu-and-mul), the decode forward of Llama-shaped decoder layers
(csrc/decode_layers.cpp, built from the others' kernel headers) and bfloat16 linears for CPUs
without native bf16 (csrc/bf16_linear.cpp, AVX2), each its own extension in its own build
directory.

The build is cached under `kernel_cache_root()`/<source hash> ($PAGEDLLM_KERNEL_CACHE_DIR, else
$PAGEDLLM_CACHE_DIR/torch_extensions, default ~/.cache/pagedllm/torch_extensions), so only the
first start on a machine compiles. If the build fails (no compiler), callers
fall back to the torch formulation and say so once in the log.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
# Each extension's files: its .cpp (compiled) and the kernel headers it includes (hashed into
# the build directory's key and copied beside it).
_SOURCES = [_CSRC / "paged_attention.cpp", _CSRC / "paged_attention.h", _CSRC / "vec_avx2.h"]
_QUANT_SOURCES = [_CSRC / "quant_linear.cpp", _CSRC / "quant_linear.h", _CSRC / "gemm_tiles.h", _CSRC / "vec_avx2.h"]
_LAYER_OPS_SOURCES = [_CSRC / "layer_ops.cpp", _CSRC / "layer_ops.h", _CSRC / "vec_avx2.h"]
_DECODE_LAYERS_SOURCES = [
    _CSRC / "decode_layers.cpp", _CSRC / "layer_ops.h", _CSRC / "paged_attention.h", _CSRC / "quant_linear.h",
    _CSRC / "gemm_tiles.h", _CSRC / "vec_avx2.h",
]
_BF16_LINEAR_SOURCES = [_CSRC / "bf16_linear.cpp", _CSRC / "gemm_tiles.h", _CSRC / "vec_avx2.h"]
# Extension name -> the loaded module, or None once it failed to build (or kernels are off).
_loaded: dict[str, ModuleType | None] = {}


def kernel_cache_root() -> str:
    """Where builds live: $PAGEDLLM_KERNEL_CACHE_DIR, else $PAGEDLLM_CACHE_DIR/torch_extensions
    (default ~/.cache/pagedllm/torch_extensions)."""
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.expanduser("~/.cache/pagedllm")
    return os.environ.get("PAGEDLLM_KERNEL_CACHE_DIR") or os.path.join(root, "torch_extensions")


def _build_dir(sources: list[Path]) -> str:
    """One directory per content of the sources: an edited kernel (or another checkout's)
    builds beside the old one instead of rebuilding over it under a running process."""
    digest = hashlib.sha256()
    for src in sources:
        digest.update(src.read_bytes())
    path = os.path.join(kernel_cache_root(), digest.hexdigest()[:16])
    os.makedirs(path, exist_ok=True)
    return path


def _local_copies(build_dir: str, sources: list[Path]) -> list[str]:
    """Build from copies inside the (content-keyed) build directory: checkouts at other paths
    with the same sources then share one build instead of rebuilding each other's."""
    copies = []
    for src in sources:
        dst = os.path.join(build_dir, src.name)
        if not os.path.exists(dst):
            shutil.copyfile(src, dst + ".tmp")
            os.replace(dst + ".tmp", dst)
        copies.append(dst)
    return copies


def _load_locked(
    build_dir: str, name: str = "pagedllm_paged_attention", sources: list[Path] = _SOURCES
) -> ModuleType:
    """Build or load the extension under an flock, which the kernel releases if we die.

    torch's own build lock is a plain file: a build killed midway leaves it behind and every
    later start waits on it forever. Holding our flock, no other pagedllm process is
    building, so such a file is stale and can go.
    """
    import fcntl

    from torch.utils.cpp_extension import load

    with open(os.path.join(build_dir, "pagedllm.flock"), "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            logger.warning("removing a stale build lock left by an interrupted build: %s", stale)
            os.remove(stale)
        return load(
            name=name,
            sources=[c for c in _local_copies(build_dir, sources) if c.endswith(".cpp")],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=build_dir,
            verbose=False,
        )


def _extension(name: str, sources: list[Path], fallback: str) -> ModuleType | None:
    """Build or load an extension once per process; None where it cannot be built (or
    PAGEDLLM_CPU_KERNELS=0), saying once in the log what runs instead."""
    if name in _loaded:
        return _loaded[name]
    module = None
    if os.environ.get("PAGEDLLM_CPU_KERNELS", "1") != "0":
        try:
            module = _load_locked(_build_dir(sources), name, sources)
        except Exception as e:  # no compiler, headers, or ninja
            logger.warning("compiled %s unavailable, %s: %s", name, fallback, str(e).splitlines()[0])
    _loaded[name] = module
    return module


def paged_attention_ops() -> ModuleType | None:
    """The compiled paged attention module, or None (the torch path runs instead)."""
    return _extension("pagedllm_paged_attention", _SOURCES, "using torch ops")


def quant_linear_ops() -> ModuleType | None:
    """The compiled weight-only quantized linear kernels (AVX2), or None where unavailable."""
    return _extension("pagedllm_quant_linear", _QUANT_SOURCES, "dequantizing per layer")


def bf16_linear_ops() -> ModuleType | None:
    """The compiled bf16-weight linear kernel (AVX2, float32 arithmetic), or None."""
    return _extension("pagedllm_bf16_linear", _BF16_LINEAR_SOURCES, "using torch's bf16 matmul")


def layer_ops() -> ModuleType | None:
    """The compiled fused layer ops (RMSNorm, rotary, silu-and-mul), or None (torch ops run)."""
    return _extension("pagedllm_layer_ops", _LAYER_OPS_SOURCES, "using torch ops")


def decode_layers_ops() -> ModuleType | None:
    """The compiled decode forward over every decoder layer (models/fused_decode.py), or None."""
    return _extension("pagedllm_decode_layers", _DECODE_LAYERS_SOURCES, "running the layers one module at a time")


_layer_ops_dtypes: tuple | None = None  # (torch.float32, torch.bfloat16), set on first use


def use_layer_ops(x) -> bool:
    """Whether the fused layer ops take x: a CPU [rows, width] float32/bfloat16 tensor with
    unit stride on width, and the extension built. Called per layer per step: kept cheap."""
    global _layer_ops_dtypes
    if _layer_ops_dtypes is None:
        import torch

        _layer_ops_dtypes = (torch.float32, torch.bfloat16)
    return (
        x.dtype in _layer_ops_dtypes
        and x.dim() == 2
        and x.is_cpu
        and x.stride(-1) == 1
        and layer_ops() is not None
    )
