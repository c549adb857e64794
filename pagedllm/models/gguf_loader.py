"""GGUF checkpoints: converted once into a cached HF-format directory, then loaded as one.

The conversion (slow the first time: transformers parses the GGUF metadata for the config and
the tokenizer, and every tensor is dequantized) writes into
`$PAGEDLLM_CACHE_DIR` or `~/.cache/pagedllm`, under `<sha256 of path, size, mtime>/`:
config.json, the tokenizer files (with the GGUF's chat template), and model.safetensors with
the float32 weights under HF names and in HF layout (llama.cpp's Q/K row permutation undone,
so HF's rotate_half rotary embedding applies).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import time
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import PretrainedConfig

    from pagedllm.layers.quantization import QuantizedWeight

logger = logging.getLogger(__name__)

_CACHE_FORMAT_VERSION = 1

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "gemma3")
# GGUF architectures whose Q/K rows llama.cpp's converter permuted (for its rope kernel).
_PERMUTED_QK_ARCHITECTURES = ("llama",)
SUPPORTED_TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Types kept as float under --quantization gguf.
GGUF_FLOAT_TYPES = ("F32", "F16", "BF16")

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3's block tensors: its norms sit around attention and MLP, and it norms q and k.
_GEMMA3_BLOCK_NAMES = _BLOCK_NAMES | {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_BLOCK_NAMES_BY_ARCH = {"gemma3": _GEMMA3_BLOCK_NAMES}
# GGUF architectures whose RMSNorm scales llama.cpp's converter stored as (1 + weight).
_NORM_PLUS_ONE_ARCHITECTURES = ("gemma3",)
# llama.cpp's precomputed llama3 rope factors; our rotary embedding derives them from config.
_SKIPPED_TENSORS = ("rope_freqs.weight",)
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


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
    import gguf
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    from pagedllm.models.config_utils import architecture_of

    reader = gguf.GGUFReader(gguf_path)
    arch = str(reader.fields["general.architecture"].contents())
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} of {gguf_path} is not supported; "
            f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    check_tensor_types(reader, gguf_path)
    # transformers reads the GGUF from a directory of its own: tokenizer or config files lying
    # beside the GGUF would otherwise be mixed into what it builds.
    src_dir = os.path.join(out_dir, "gguf-src")
    os.makedirs(src_dir)
    basename = os.path.basename(gguf_path)
    os.symlink(os.path.realpath(gguf_path), os.path.join(src_dir, basename))
    hf_config = AutoConfig.from_pretrained(src_dir, gguf_file=basename)
    hf_config.architectures = [architecture_of(hf_config)]
    tensors = dict(read_gguf_tensors(reader, hf_config, arch))
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    del tensors
    hf_config.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(src_dir, gguf_file=basename).save_pretrained(out_dir)
    shutil.rmtree(src_dir)


def check_tensor_types(reader: GGUFReader, gguf_path: str) -> None:
    """ValueError naming the supported types if any tensor's type cannot be dequantized."""
    bad = sorted({t.tensor_type.name for t in reader.tensors} - set(SUPPORTED_TENSOR_TYPES))
    if bad:
        raise ValueError(
            f"{gguf_path} has tensors of unsupported type {', '.join(bad)}; "
            f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
        )


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor of `arch`, None for tensors that are not loaded."""
    if gguf_name in _SKIPPED_TENSORS:
        return None
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    block_names = _BLOCK_NAMES_BY_ARCH.get(arch, _BLOCK_NAMES)
    m = _BLOCK_RE.fullmatch(gguf_name)
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
    reader: GGUFReader, hf_config: PretrainedConfig, arch: str, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(HF name, float32 tensor in HF layout) for every loadable tensor of the file.

    keep_quantized: 2-D tensors of a type in GGUF_QUANT_TYPES come as QuantizedWeight (rows
    in HF order) instead; any other non-float type is a ValueError naming the supported ones.
    """
    from gguf.quants import dequantize

    from pagedllm.models.gguf_quant import gguf_quantized_weight

    permute_qk = arch in _PERMUTED_QK_ARCHITECTURES
    norm_plus_one = arch in _NORM_PLUS_ONE_ARCHITECTURES
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    for t in reader.tensors:
        name = hf_tensor_name(t.name, arch)
        if name is None:
            continue
        # GGUF lists dims fastest-first; HF shapes are the reverse.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        heads = None
        if permute_qk and ".q_proj." in name:
            heads = num_heads
        elif permute_qk and ".k_proj." in name:
            heads = num_kv_heads
        type_name = t.tensor_type.name
        if keep_quantized and type_name not in GGUF_FLOAT_TYPES and len(shape) == 2:
            qw = gguf_quantized_weight(t.data, type_name, shape)  # type: ignore[arg-type]
            if heads is not None:
                # Row permutations commute with per-row group quantization.
                qw = qw.rows(torch.from_numpy(unpermute_qk(np.arange(shape[0]), heads)))
            yield name, qw
            continue
        w = dequantize(t.data, t.tensor_type).reshape(shape)
        if heads is not None:
            w = unpermute_qk(w, heads)
        elif norm_plus_one and name.endswith("norm.weight"):
            w = w - 1.0  # back to HF's offset-from-one form
        yield name, torch.from_numpy(np.array(w, dtype=np.float32, copy=True))


@functools.lru_cache(maxsize=2)
def _open_gguf(gguf_path: str, mtime_ns: int, size: int) -> GGUFReader:
    import gguf

    return gguf.GGUFReader(gguf_path)


def open_gguf(gguf_path: str) -> GGUFReader:
    """A reader of the file, parsed once per load: parsing the metadata (the tokenizer's
    vocabulary field by field) takes seconds, and a load reads the file three times (type
    check, quantization choice, weights). `release_gguf_readers()` drops them after the load."""
    st = os.stat(gguf_path)
    return _open_gguf(os.path.abspath(gguf_path), st.st_mtime_ns, st.st_size)


def release_gguf_readers() -> None:
    _open_gguf.cache_clear()


def gguf_quant_types(gguf_path: str) -> set[str]:
    """The tensor types of a GGUF file's 2-D weights."""
    reader = open_gguf(gguf_path)
    return {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}


def check_gguf_quant_types(gguf_path: str) -> None:
    """ValueError naming the supported types unless --quantization gguf can keep the file's."""
    from pagedllm.models.gguf_quant import GGUF_QUANT_TYPES

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
    reader = open_gguf(gguf_path)
    arch = str(reader.fields["general.architecture"].contents())
    yield from read_gguf_tensors(reader, hf_config, arch, keep_quantized=True)
