"""GGUF checkpoints: converted once into a cached HF-format directory, then loaded as one.

The conversion (slow the first time: transformers parses the GGUF metadata for the config and
the tokenizer, and every tensor is dequantized) writes into
`$PAGEDLLM_CACHE_DIR` or `~/.cache/pagedllm`, under `<sha256 of path, size, mtime>/`:
config.json, the tokenizer files (with the GGUF's chat template), and model.safetensors with
the float32 weights under HF names and in HF layout (llama.cpp's Q/K row permutation undone,
so HF's rotate_half rotary embedding applies), and gguf_index.json: the file's tensor table
(name, type, shape, byte offset) and architecture. With that index a warm start reads the
quantized blocks straight from a memory map of the GGUF file and never parses its metadata
(gguf-py reads the tokenizer's vocabulary field by field: seconds for a 49k vocabulary).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import numpy as np
import torch

from pagedllm.models.family import GGUFSpec
from pagedllm.models.gguf_index import (
    GGUF_FLOAT_TYPES,
    GGUFIndex,
    GGUFTensorInfo,
    index_from_reader,
    load_index,
    save_index,
    tensor_data,
)
from pagedllm.models.gguf_quant import GGUF_QUANT_TYPES, gguf_quantized_weight
from pagedllm.models.registry import gguf_family

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from pagedllm.kernels import QuantizedWeight

logger = logging.getLogger(__name__)

# 2: Llama-3 rope scaling recovered from rope_freqs (models/gguf_rope.py); a cache written
# before it holds plain rope for those files, so every file converts once more.
_CACHE_FORMAT_VERSION = 2

# The architectures and their tensor names: each family's GGUFSpec (models/family.py).
SUPPORTED_TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Mixtral files written before llama.cpp stacked experts (early 2024): one 2-D tensor per
# expert, blk.N.ffn_gate.E.weight; read as the stacked form's slices.
_PER_EXPERT_RE = re.compile(r"blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight")


def cache_root() -> str:
    return os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.expanduser("~/.cache/pagedllm")


def cache_dir_for(gguf_path: str) -> str:
    """Where the converted checkpoint of this exact file (path, size, mtime) lives."""
    path = os.path.realpath(gguf_path)
    st = os.stat(path)
    key = f"v{_CACHE_FORMAT_VERSION}\0{path}\0{st.st_size}\0{st.st_mtime_ns}"
    return os.path.join(cache_root(), hashlib.sha256(key.encode()).hexdigest())


def gguf_to_hf_dir(gguf_path: str) -> str:
    """The cached HF-format directory of a GGUF file, converting it on first use."""
    out_dir = cache_dir_for(gguf_path)
    if os.path.isdir(out_dir):
        logger.info("using converted GGUF %s from cache %s", gguf_path, out_dir)
        return out_dir
    start = time.perf_counter()
    # Build in a private directory and rename: concurrent first loads never see half a cache.
    tmp_dir = f"{out_dir}.tmp.{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    try:
        _convert(gguf_path, tmp_dir)
        try:
            os.rename(tmp_dir, out_dir)
        except OSError:  # another process finished first; its copy is as good
            assert os.path.isdir(out_dir), out_dir
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    logger.info(
        "converted GGUF %s in %.1f s, cached at %s", gguf_path, time.perf_counter() - start, out_dir
    )
    return out_dir


def _convert(gguf_path: str, out_dir: str) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    from pagedllm.models.config_utils import architecture_of

    index = gguf_index(gguf_path)  # parsed once per process, shared with resolve_quantization
    try:
        spec = gguf_family(index.architecture).gguf
    except ValueError as e:
        raise ValueError(f"{gguf_path}: {e}") from None
    assert spec is not None
    check_tensor_types(index.type_names(), gguf_path)
    # transformers reads the GGUF from a directory of its own: tokenizer or config files lying
    # beside the GGUF would otherwise be mixed into what it builds.
    src_dir = os.path.join(out_dir, "gguf-src")
    os.makedirs(src_dir)
    basename = os.path.basename(gguf_path)
    os.symlink(os.path.realpath(gguf_path), os.path.join(src_dir, basename))
    hf_config = AutoConfig.from_pretrained(src_dir, gguf_file=basename)
    hf_config.architectures = [architecture_of(hf_config)]
    if spec.config_from_gguf is not None:
        for key, value in spec.config_from_gguf(_reader_of(gguf_path), hf_config).items():
            setattr(hf_config, key, value)
    _reader.cache_clear()  # the conversion is its last user
    tensors = dict(read_gguf_tensors(index, hf_config))
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    del tensors
    hf_config.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(src_dir, gguf_file=basename).save_pretrained(out_dir)
    shutil.rmtree(src_dir)
    save_index(index, out_dir)


def check_tensor_types(type_names: Iterable[str], gguf_path: str) -> None:
    """ValueError naming the supported types if any tensor's type cannot be dequantized."""
    bad = sorted(set(type_names) - set(SUPPORTED_TENSOR_TYPES))
    if bad:
        raise ValueError(
            f"{gguf_path} has tensors of unsupported type {', '.join(bad)}; "
            f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
        )


def gguf_spec(arch: str) -> GGUFSpec:
    """The declared GGUFSpec of a GGUF architecture; ValueError naming the supported ones."""
    spec = gguf_family(arch).gguf
    assert spec is not None
    return spec


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor of `arch`, None for tensors that are not loaded."""
    spec = gguf_spec(arch)
    if gguf_name in spec.skipped_tensors:
        return None
    base, _, kind = gguf_name.rpartition(".")
    if base in spec.global_names:
        return f"{spec.global_names[base]}.{kind}"
    block_names = {**spec.block_names, **spec.optional_block_names}
    m = _BLOCK_RE.fullmatch(gguf_name)
    legacy = _PER_EXPERT_RE.fullmatch(gguf_name)
    if legacy is not None and f"{legacy.group(2)}_exps" in block_names:
        part = block_names[f"{legacy.group(2)}_exps"].format(expert=legacy.group(3))
        return f"model.layers.{legacy.group(1)}.{part}.weight"
    if m is None or m.group(2) not in block_names:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF name")
    return f"model.layers.{m.group(1)}.{block_names[m.group(2)]}.{m.group(3)}"


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp stores each head's rows interleaved as (x1[0], x2[0], x1[1], x2[1], ...) where
    # HF keeps halves (x1[0..D/2), x2[0..D/2)). w: [num_heads * D, ...] (weight or bias).
    # View rows as [heads, D/2, 2] and transpose the last two to get [heads, 2, D/2] back.
    head_dim = w.shape[0] // num_heads
    rest = w.shape[1:]
    w = w.reshape(num_heads, head_dim // 2, 2, *rest).swapaxes(1, 2)
    return w.reshape(num_heads * head_dim, *rest)


def read_gguf_tensors(
    index: GGUFIndex, hf_config: PretrainedConfig, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(HF name, float32 tensor in HF layout) for every loadable tensor of the file, read by
    offset from a memory map of it.

    keep_quantized: 2-D tensors of a type in GGUF_QUANT_TYPES come as QuantizedWeight (rows
    in HF order) instead; any other non-float type is a ValueError naming the supported ones.
    """
    arch = index.architecture
    spec = gguf_spec(arch)
    permute_qk, norm_plus_one = spec.permuted_qk, spec.norm_plus_one
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    file_map = index.open_data()
    for t in index.tensors:
        name = hf_tensor_name(t.name, arch)
        if name is None:
            continue
        shape = t.shape
        heads = None
        if permute_qk and ".q_proj." in name:
            heads = num_heads
        elif permute_qk and ".k_proj." in name:
            heads = num_kv_heads
        data = tensor_data(file_map, t)
        if "{expert}" in name:  # a 3-D stack [E, rows, cols]: one 2-D tensor per expert
            for e in range(shape[0]):
                yield from _tensor_items(name.format(expert=e), data[e], t.type_name, shape[1:], keep_quantized)
            continue
        if keep_quantized and t.type_name not in GGUF_FLOAT_TYPES and len(shape) == 2:
            qw = gguf_quantized_weight(data, t.type_name, shape)  # type: ignore[arg-type]
            if heads is not None:
                # Row permutations commute with per-row group quantization.
                qw = qw.rows(torch.from_numpy(unpermute_qk(np.arange(shape[0]), heads)))
            yield name, qw
            continue
        w = _dequantize(data, t).reshape(shape)
        if heads is not None:
            w = unpermute_qk(w, heads)
        elif norm_plus_one and name.endswith("norm.weight"):
            w = w - 1.0  # back to HF's offset-from-one form
        yield name, torch.from_numpy(np.array(w, dtype=np.float32, copy=True))


def _tensor_items(
    name: str, data: np.ndarray, type_name: str, shape: tuple[int, ...], keep_quantized: bool
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    # One expert's 2-D slice of a 3-D tensor (no permutation, no norm: experts have neither).
    if keep_quantized and type_name not in GGUF_FLOAT_TYPES:
        yield name, gguf_quantized_weight(data, type_name, shape)  # type: ignore[arg-type]
        return
    w = _dequantize_raw(data, type_name).reshape(shape)
    yield name, torch.from_numpy(np.array(w, dtype=np.float32, copy=True))


def _dequantize(data: np.ndarray, tensor: GGUFTensorInfo) -> np.ndarray:
    return _dequantize_raw(data, tensor.type_name)


def _dequantize_raw(data: np.ndarray, type_name: str) -> np.ndarray:
    if type_name in ("F32", "F16"):
        return data  # gguf-py would only convert it
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(data, GGMLQuantizationType[type_name])


@functools.lru_cache(maxsize=4)
def _gguf_index(path: str, size: int, mtime_ns: int) -> GGUFIndex:
    cache_dir = cache_dir_for(path)
    index = load_index(cache_dir, path)
    if index is not None:
        return index
    start = time.perf_counter()
    index = index_from_reader(_reader_of(path), path)
    logger.info("parsed the metadata of %s in %.1f s", path, time.perf_counter() - start)
    if os.path.isdir(cache_dir):  # else the conversion writes it
        save_index(index, cache_dir)
    return index


@functools.lru_cache(maxsize=1)
def _reader(path: str, size: int, mtime_ns: int) -> Any:
    import gguf

    return gguf.GGUFReader(path)


def _reader_of(gguf_path: str) -> Any:
    """gguf-py's reader of the file, parsed once for a cold index and the conversion's
    `config_from_gguf` together (seconds for a large vocabulary); dropped after conversion."""
    path = os.path.realpath(gguf_path)
    st = os.stat(path)
    return _reader(path, st.st_size, st.st_mtime_ns)


def gguf_index(gguf_path: str) -> GGUFIndex:
    """The file's tensor table: from the conversion cache while the file is unchanged (path,
    size, mtime), else parsed (once per process) and saved there."""
    path = os.path.realpath(gguf_path)
    st = os.stat(path)
    return _gguf_index(path, st.st_size, st.st_mtime_ns)


def gguf_quant_types(gguf_path: str) -> set[str]:
    """The tensor types of a GGUF file's weights: its 2-D matrices and 3-D expert stacks
    (each expert's slice a matrix)."""
    index = gguf_index(gguf_path)
    return index.type_names(ndim=2) | index.type_names(ndim=3)


def check_gguf_quant_types(gguf_path: str) -> None:
    """ValueError naming the supported types unless --quantization gguf can keep the file's."""
    bad = sorted(gguf_quant_types(gguf_path) - set(GGUF_QUANT_TYPES) - set(GGUF_FLOAT_TYPES))
    if bad:
        raise ValueError(
            f"{gguf_path} has weights of type {', '.join(bad)}, which --quantization gguf cannot "
            f"keep quantized; supported: {', '.join(GGUF_QUANT_TYPES)} (float: "
            f"{', '.join(GGUF_FLOAT_TYPES)}); use --quantization none (dequantize to --dtype) "
            "or int8 / int4 (requantize at load)"
        )


def read_gguf_quantized(
    gguf_path: str, hf_config: PretrainedConfig
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The file's weights with its quantized projections kept quantized (--quantization gguf)."""
    check_gguf_quant_types(gguf_path)
    yield from read_gguf_tensors(gguf_index(gguf_path), hf_config, keep_quantized=True)
