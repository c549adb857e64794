"""Compiled CPU kernels (C++/OpenMP through torch.utils.cpp_extension), built on first use:
paged attention (csrc/paged_attention.cpp), weight-only quantized linears
(csrc/quant_linear.cpp, AVX2), fused elementwise layer ops (csrc/layer_ops.cpp: RMSNorm,
rotary, silu-and-mul), the decode forward of Llama-shaped decoder layers
(csrc/decode_layers.cpp, built from the others' kernel headers), bfloat16 linears for CPUs
without native bf16 (csrc/bf16_linear.cpp, AVX2) and the kernels over GGUF weights kept as
the file's blocks (csrc/gguf_blocks.cpp), each its own extension in its own build directory.

Instruction-set levels (`isa.py`, platforms/isa.py: generic, avx2, avx512, amx): each level
builds with its own explicit -m flags into its own directory. An extension declares the
lowest level it has code for (`min_isa`): paged attention and the layer ops build their
scalar code under "generic"; the AVX2-only extensions (quantized linears, bf16 linears, the
fused decode) are not built below "avx2" and their callers' torch paths run. Headers select
their wider paths with the level's macros (__AVX512VNNI__ ...), so an avx512 build runs the
512-bit code and an avx2 build of the same source does not.
The GGUF block kernels (csrc/gguf_blocks.cpp) have scalar code for every type and build at
every level.

The build is cached under `kernel_cache_root()`/<isa>-<key> ($PAGEDLLM_KERNEL_CACHE_DIR, else
$PAGEDLLM_CACHE_DIR/torch_extensions, default ~/.cache/pagedllm/torch_extensions). The key
hashes the sources, the ISA with its compile flags and the instruction-set macros the compiler
defines under them, the compiler (path and version), torch's version and the Python ABI: a
cache shared between machines never loads a binary built for another CPU or toolchain (what
the compiler says is itself cached by its binary and flags, isa.compiler_info, so a start
runs no compiler). A finished build is imported without ninja (`_load_locked`). If the build fails (no compiler),
callers fall back to the torch formulation and say so once in the log.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from pagedllm.kernels.isa import Isa, compiler_info, cpu_isa, isa_at_least, isa_cflags, kernel_cache_root
from pagedllm.platforms.host import is_host_tensor

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"


@dataclass(frozen=True)
class Extension:
    """One compiled extension: its .cpp (compiled) and the headers it includes (hashed into
    the key and copied beside the build)."""

    name: str
    sources: tuple[str, ...]
    fallback: str
    """what runs where the extension is unavailable (for the log)"""
    min_isa: Isa
    """the lowest level it has code for: not built below it (its caller's torch path runs)"""


# Short name -> extension; the accessors below are the only readers.
EXTENSIONS: dict[str, Extension] = {
    e.name: e
    for e in (
        Extension("paged_attention", ("paged_attention.cpp", "paged_attention.h", "kv_codes.h", "vec_avx2.h"),
                  "using torch ops", min_isa="generic"),
        Extension("layer_ops", ("layer_ops.cpp", "layer_ops.h", "vec_avx2.h"), "using torch ops", min_isa="generic"),
        Extension("quant_linear", ("quant_linear.cpp", "quant_linear.h", "quant_q16_avx512.h", "quant_q8.h",
                                   "quant_scales.h", "gemm_tiles.h", "vec_avx2.h"),
                  "dequantizing per layer", min_isa="avx2"),
        Extension("bf16_linear", ("bf16_linear.cpp", "gemm_tiles.h", "vec_avx2.h"),
                  "using torch's bf16 matmul", min_isa="avx2"),
        Extension("decode_layers", ("decode_layers.cpp", "layer_ops.h", "paged_attention.h", "kv_codes.h", "quant_linear.h",
                                    "quant_q16_avx512.h", "quant_scales.h", "gemm_tiles.h", "vec_avx2.h",
                                    "lora_delta.h", "decode_gguf_linear.h", "gguf_matmul.h", "gguf_moe.h",
                                    "gguf_decode.h", "gguf_types.h", "gguf_dot_avx512.h", "gguf_dot_int8_avx512.h"),
                  "running the layers one module at a time", min_isa="avx2"),
        Extension("gguf_linear", ("gguf_blocks.cpp", "gguf_matmul.h", "gguf_moe.h", "gguf_decode.h", "gguf_types.h",
                                  "gguf_dot_avx512.h", "gguf_dot_int8_avx512.h"),
                  "dequantizing GGUF blocks with gguf-py", min_isa="generic"),
    )
}

# (extension name, ISA) -> the loaded module, or None once it failed to build (or is off).
_loaded: dict[tuple[str, Isa], ModuleType | None] = {}


def module_name(ext: Extension, isa: Isa) -> str:
    """The Python module name of a build: one per ISA, so both can load in one process."""
    return f"pagedllm_{ext.name}_{isa}"


def build_key(ext: Extension, isa: Isa) -> dict[str, object]:
    """Everything a build's binary depends on; its hash names the build directory."""
    import torch

    cc = compiler_info(isa)
    return {
        "module": module_name(ext, isa),
        "sources": {name: hashlib.sha256((CSRC / name).read_bytes()).hexdigest() for name in ext.sources},
        "isa": isa,
        "cflags": isa_cflags(isa),
        "isa_macros": cc.isa_macros,
        "compiler": cc.path,
        "compiler_version": cc.version,
        "torch": torch.__version__,
        "python": sys.implementation.cache_tag,
    }


def build_dir(ext: Extension, isa: Isa) -> str:
    """One directory per build key: an edited kernel (or another checkout's, CPU's, compiler's)
    builds beside the old one instead of over it under a running process."""
    key = build_key(ext, isa)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(kernel_cache_root(), f"{isa}-{digest}")
    os.makedirs(path, exist_ok=True)
    record = os.path.join(path, "build_key.json")
    if not os.path.exists(record):
        with open(record + ".tmp", "w") as f:
            json.dump(key, f, indent=1, sort_keys=True)
        os.replace(record + ".tmp", record)
    return path


def _local_copies(path: str, ext: Extension) -> list[str]:
    """Build from copies inside the (content-keyed) build directory: checkouts at other paths
    with the same sources then share one build instead of rebuilding each other's."""
    copies = []
    for name in ext.sources:
        dst = os.path.join(path, name)
        if not os.path.exists(dst):
            shutil.copyfile(CSRC / name, dst + ".tmp")
            os.replace(dst + ".tmp", dst)
        copies.append(dst)
    return copies


# Written into a build directory once its library has been built and imported.
BUILT_STAMP = "built.stamp"


def _import_built(name: str, library: str) -> ModuleType:
    """Import a finished build's library directly (torch is imported: it links against it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, library)
    assert spec is not None and spec.loader is not None, library
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_locked(path: str, ext: Extension, isa: Isa) -> ModuleType:
    """Build or load the extension under an flock, which the kernel releases if we die.

    torch's own build lock is a plain file: a build killed midway leaves it behind and every
    later start waits on it forever. Holding our flock, no other pagedllm process is
    building, so such a file is stale and can go.

    A directory with BUILT_STAMP holds a finished build of exactly its key's sources and flags:
    its library is imported without running ninja again. ninja would otherwise recompile on
    things the key does not cover: torch runs whichever `ninja` PATH finds first, and ninja
    1.11 (a system package) and 1.13 (pyproject's `ninja` wheel, first on PATH in an activated
    venv) hash commands differently, each reading the other's .ninja_log as "command line
    changed": starts alternating between the two recompiled every object.
    """
    import fcntl

    name = module_name(ext, isa)
    library = os.path.join(path, f"{name}.so")
    with open(os.path.join(path, "pagedllm.flock"), "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        if os.path.exists(os.path.join(path, BUILT_STAMP)) and os.path.exists(library):
            return _import_built(name, library)
        from torch.utils.cpp_extension import load  # 0.3-0.4 s of imports (setuptools): builds only

        stale = os.path.join(path, "lock")
        if os.path.exists(stale):
            logger.warning("removing a stale build lock left by an interrupted build: %s", stale)
            os.remove(stale)
        module = load(
            name=name,
            sources=[c for c in _local_copies(path, ext) if c.endswith(".cpp")],
            extra_cflags=isa_cflags(isa),
            extra_ldflags=["-fopenmp"],
            build_directory=path,
            verbose=False,
        )
        with open(os.path.join(path, BUILT_STAMP), "w") as f:
            f.write(f"{name}.so\n")
        return module


_enabled = True  # set_compiled_kernels: the engine's AttentionConfig.compiled_kernels


def set_compiled_kernels(enabled: bool) -> None:
    """Whether later lookups build and load extensions (False: every caller's torch path;
    the engine's builder sets it from ``AttentionConfig.compiled_kernels``); read on every
    lookup, though a caller may keep what a lookup gave it."""
    global _enabled
    _enabled = enabled


def compiled_kernels_enabled() -> bool:
    return _enabled


def extension(name: str, isa: Isa | None = None) -> ModuleType | None:
    """Build or load an extension once per process and ISA level (default: `cpu_isa()`);
    None where it cannot be built, has no code for the level (`min_isa`), or compiled
    kernels are off (`set_compiled_kernels`), saying once in the log what runs instead."""
    isa = isa or cpu_isa()
    if not _enabled:
        return None
    key = (name, isa)
    if key in _loaded:
        return _loaded[key]
    ext = EXTENSIONS[name]
    module = None
    if not isa_at_least(isa, ext.min_isa):
        logger.info("%s has no %s build (%s and up), %s", name, isa, ext.min_isa, ext.fallback)
    else:
        try:
            module = _load_locked(build_dir(ext, isa), ext, isa)
        except Exception as e:  # no compiler, headers (the sources missing from an install), or ninja
            logger.warning("compiled %s unavailable, %s: %s", name, ext.fallback, str(e).splitlines()[0])
    _loaded[key] = module
    return module


def paged_attention_ops() -> ModuleType | None:
    """The compiled paged attention module, or None (the torch path runs instead)."""
    return extension("paged_attention")


def quant_linear_ops() -> ModuleType | None:
    """The compiled weight-only quantized linear kernels (AVX2), or None where unavailable."""
    return extension("quant_linear")


def bf16_linear_ops() -> ModuleType | None:
    """The compiled bf16-weight linear kernel (AVX2, float32 arithmetic), or None."""
    return extension("bf16_linear")


def gguf_linear_ops() -> ModuleType | None:
    """The compiled GGUF block kernels (csrc/gguf_blocks.cpp; every ISA), or None."""
    return extension("gguf_linear")


def layer_ops() -> ModuleType | None:
    """The compiled fused layer ops (RMSNorm, rotary, silu-and-mul), or None (torch ops run)."""
    return extension("layer_ops")


def decode_layers_ops() -> ModuleType | None:
    """The compiled decode forward over every decoder layer (models/fused_decode.py), or None."""
    return extension("decode_layers")


_layer_ops_dtypes: tuple | None = None  # (torch.float32, torch.bfloat16), set on first use


def use_layer_ops(x) -> bool:
    """Whether the fused layer ops take x: a host-memory [rows, width] float32/bfloat16 tensor with
    unit stride on width, and the extension built. Called per layer per step: kept cheap."""
    global _layer_ops_dtypes
    if _layer_ops_dtypes is None:
        import torch

        _layer_ops_dtypes = (torch.float32, torch.bfloat16)
    return (
        x.dtype in _layer_ops_dtypes
        and x.dim() == 2
        and is_host_tensor(x)
        and x.stride(-1) == 1
        and layer_ops() is not None
    )
