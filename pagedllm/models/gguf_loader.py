"""GGUF checkpoints: metadata cached once as an HF-format directory, weights read from the file.

The first load of a file writes into `$PAGEDLLM_CACHE_DIR` or `~/.cache/pagedllm`, under
`<sha256 of format version, path, size, mtime>/`, only what is metadata: config.json (from
transformers' GGUF reader plus the family's `config_from_gguf`, or the family's own
`metadata_from_gguf` where that reader lacks or misreads the architecture), the tokenizer files (with
the GGUF's chat template) and gguf_index.json, the tensor table of the file and its splits
(gguf_index.py), built from the validated headers (gguf_header.py). No weights are written:
every load reads each tensor with a positional read of the file into its kept form
(gguf_quant.py), one tensor at a time, so no float copy of the model exists at any moment.
"""

from __future__ import annotations

import contextlib
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

from pagedllm.kernels.gguf_blocks import KEPT_GGUF_TYPES
from pagedllm.models.family import GGUFSpec
from pagedllm.models.gguf_index import GGUFIndex, index_from_headers, load_index, read_ahead, save_index
from pagedllm.models.gguf_quant import (
    DEQUANTIZED_TYPES,
    KeptMatrix,
    KeptTensor,
    TransposedKept,
    kept_bytes,
    kept_gguf_tensor,
)
from pagedllm.models.registry import gguf_family

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

# 3: metadata only (no model.safetensors; weights come from the file), index v2 (splits).
_CACHE_FORMAT_VERSION = 3

# The types a load reads: kept as they are, dequantized to BF16 per tensor, or F32.
SUPPORTED_TENSOR_TYPES = ("F32", *KEPT_GGUF_TYPES, *DEQUANTIZED_TYPES)

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Mixtral files written before llama.cpp stacked experts (early 2024): one 2-D tensor per
# expert, blk.N.ffn_gate.E.weight; read as the stacked form's slices.
_PER_EXPERT_RE = re.compile(r"blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight")


def cache_root() -> str:
    return os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.expanduser("~/.cache/pagedllm")


def cache_dir_for(gguf_path: str) -> str:
    """Where the metadata of this exact file (path, size, mtime) is cached."""
    path = os.path.realpath(gguf_path)
    st = os.stat(path)
    key = f"v{_CACHE_FORMAT_VERSION}\0{path}\0{st.st_size}\0{st.st_mtime_ns}"
    return os.path.join(cache_root(), hashlib.sha256(key.encode()).hexdigest())


def gguf_to_hf_dir(gguf_path: str) -> str:
    """The cached HF-format metadata directory (config, tokenizer, tensor index; no weights)
    of a GGUF file, written on first use."""
    out_dir = cache_dir_for(gguf_path)
    if os.path.isdir(out_dir):
        logger.info("using the GGUF metadata of %s from cache %s", gguf_path, out_dir)
        return out_dir
    start = time.perf_counter()
    # Build in a private directory and rename: concurrent first loads never see half a cache.
    tmp_dir = f"{out_dir}.tmp.{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    try:
        _write_metadata(gguf_path, tmp_dir)
        try:
            os.rename(tmp_dir, out_dir)
        except OSError:  # another process finished first; its copy is as good
            assert os.path.isdir(out_dir), out_dir
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    logger.info("read the GGUF metadata of %s in %.1f s, cached at %s", gguf_path, time.perf_counter() - start, out_dir)
    return out_dir


def _write_metadata(gguf_path: str, out_dir: str) -> None:
    index = gguf_index(gguf_path)  # validates the header before transformers and gguf-py read it
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
    # The header is valid (gguf_index); its values may still be nonsense to transformers' reader.
    try:
        with _one_fast_reader():
            hf_config, tokenizer = _config_and_tokenizer(index, spec, src_dir, basename)
    except _METADATA_ERRORS as e:
        raise ValueError(f"{gguf_path}: its metadata cannot be read as a model: {type(e).__name__}: {e}") from None
    hf_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    shutil.rmtree(src_dir)
    save_index(index, out_dir)


def _config_and_tokenizer(index: GGUFIndex, spec: GGUFSpec, src_dir: str, basename: str) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoTokenizer

    from pagedllm.models.config_utils import architecture_of

    if spec.metadata_from_gguf is not None:  # an architecture transformers' GGUF reader lacks
        import gguf

        hf_config, tokenizer = spec.metadata_from_gguf(gguf.GGUFReader(index.path), os.path.dirname(src_dir))
        hf_config.tie_word_embeddings = False
        if tokenizer is None:  # the file's tokenizer.ggml.* as transformers builds it (no config needed)
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast.from_pretrained(src_dir, gguf_file=basename)
        check_config_matches(index, hf_config)
        return hf_config, tokenizer
    hf_config = AutoConfig.from_pretrained(src_dir, gguf_file=basename)
    hf_config.architectures = [architecture_of(hf_config)]
    # From the whole index: a split model's head may lie in a later split.
    hf_config.tie_word_embeddings = all(t.name != "output.weight" for t in index.tensors)
    if spec.config_from_gguf is not None:
        import gguf

        for key, value in spec.config_from_gguf(gguf.GGUFReader(index.path), hf_config).items():
            setattr(hf_config, key, value)
    check_config_matches(index, hf_config)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=basename)
    return hf_config, tokenizer


@contextlib.contextmanager
def _one_fast_reader() -> Iterator[None]:
    """While the metadata is written, `gguf.GGUFReader` (which transformers' config and
    tokenizer loaders and the families' config_from_gguf each construct) parses each file once
    and over a plain array: gguf-py's reader slices a numpy memmap per value, and a memmap's
    Python-level view hooks made a 49k-token vocabulary's parse ~10 s, three times over."""
    import gguf

    original = gguf.GGUFReader
    if not isinstance(original, type):  # replaced by something else (a test's stand-in): use it as is
        yield
        return
    parsed: dict[str, Any] = {}

    class ArrayReader(original):  # type: ignore[misc, valid-type]
        def __new__(cls, path: Any, mode: str = "r") -> Any:
            key = f"{os.path.realpath(path)}\0{mode}"
            if key not in parsed:
                parsed[key] = reader = super().__new__(cls)
                reader._parsed = False
            return parsed[key]

        def __init__(self, path: Any, mode: str = "r") -> None:
            if not self._parsed:
                super().__init__(path, mode)
                self._parsed = True

        @property
        def data(self) -> np.ndarray:
            return self._array

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._array = value.view(np.ndarray)  # the memmap's buffer, without the subclass

    gguf.GGUFReader = ArrayReader
    try:
        yield
    finally:
        gguf.GGUFReader = original


# Whatever transformers' GGUF reader raises on metadata it does not expect (wrong value
# types, missing keys, zero sizes, its config validators): the file is input, so each becomes
# a ValueError naming it.
_METADATA_ERRORS = (Exception,)
# Longer contexts than any model's (Llama 4 Scout: 10M) are a corrupt field; the rotary table
# and the KV check are sized by it.
_MAX_CONTEXT = 1 << 26


def check_config_matches(index: GGUFIndex, hf_config: Any) -> None:
    """ValueError unless the metadata's sizes agree with the tensor table: the embedding is
    [vocab, hidden] and the blocks number num_hidden_layers (a model is never built from
    sizes the weights do not have)."""
    embd = next((t for t in index.tensors if t.name == "token_embd.weight"), None)
    want = (int(hf_config.vocab_size), int(hf_config.hidden_size))
    if embd is None or embd.shape != want:
        found = "none" if embd is None else list(embd.shape)
        raise ValueError(f"{index.path}: token_embd.weight is {found}, the metadata says [vocab, hidden] = {list(want)}")
    blocks = {int(m.group(1)) for t in index.tensors if (m := _BLOCK_RE.fullmatch(t.name))}
    num_layers = int(hf_config.num_hidden_layers)
    if len(blocks) != num_layers or max(blocks, default=-1) != num_layers - 1:
        raise ValueError(
            f"{index.path}: the tensors fill {len(blocks)} blocks (0..{max(blocks, default=-1)}), "
            f"the metadata says {num_layers} layers"
        )
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or want[1] // max(heads, 1))
    q = next((t for t in index.tensors if t.name == "blk.0.attn_q.weight"), None)
    k = next((t for t in index.tensors if t.name == "blk.0.attn_k.weight"), None)
    if heads < 1 or kv_heads < 1 or heads % kv_heads or (q is not None and q.shape[0] != heads * head_dim) or (
        k is not None and k.shape[0] != kv_heads * head_dim
    ):
        raise ValueError(
            f"{index.path}: the metadata's {heads} heads / {kv_heads} KV heads of {head_dim} do not fit "
            f"the attention tensors ({None if q is None else list(q.shape)}, {None if k is None else list(k.shape)})"
        )
    if not 0 < int(hf_config.max_position_embeddings) <= _MAX_CONTEXT:
        raise ValueError(
            f"{index.path}: context length {hf_config.max_position_embeddings} is out of range (1..{_MAX_CONTEXT})"
        )


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
        return f"{spec.block_prefix}.{legacy.group(1)}.{part}.weight"
    if m is None or m.group(2) not in block_names:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF name")
    return f"{spec.block_prefix}.{m.group(1)}.{block_names[m.group(2)]}.{m.group(3)}"


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
) -> Iterator[tuple[str, KeptTensor]]:
    """(HF name, tensor in HF layout) for every loadable tensor of the file, read by offset
    with positional reads of it (and its splits), one at a time.

    keep_quantized: every matrix (2-D tensor, or a 3-D expert stack's 2-D slice) comes in its
    kept form (gguf_quant.kept_gguf_tensor: QuantizedWeight, GGUFBlocks, or F32 as float32);
    else, and for vectors (norms, biases), a float32 tensor dequantized from that tensor alone.
    A matrix the family's HF checkpoints store transposed (GGUFSpec.hf_transposed) comes as
    HF has it: a transposed view, or a kept one wrapped in gguf_quant.TransposedKept.
    """
    arch = index.architecture
    spec = gguf_spec(arch)
    permute_qk, norm_plus_one = spec.permuted_qk, spec.norm_plus_one
    transposed = tuple(f".{spec.block_names[n]}.weight" for n in spec.hf_transposed)
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    names = {t.name: hf_tensor_name(t.name, arch) for t in index.tensors}
    wanted = [t for t in index.tensors if names[t.name] is not None]
    dequantized: list[str] = []
    for t, data in read_ahead(index.open_data(), wanted):
        name = names[t.name]
        assert name is not None
        shape = t.shape
        heads = None
        if permute_qk and ".q_proj." in name:
            heads = num_heads
        elif permute_qk and ".k_proj." in name:
            heads = num_kv_heads
        if keep_quantized and t.type_name in DEQUANTIZED_TYPES and len(shape) >= 2:
            dequantized.append(f"{t.name} ({t.type_name})")
        if "{expert}" in name and len(shape) == 2:  # a stack of expert biases [E, rows] (gpt-oss)
            stack = np.asarray(_dequantize_raw(data, t.type_name), dtype=np.float32).reshape(shape)
            for e in range(shape[0]):
                yield name.format(expert=e), torch.from_numpy(stack[e].copy())
            continue
        if "{expert}" in name:  # a 3-D stack [E, rows, cols]: one 2-D tensor per expert
            for e in range(shape[0]):
                yield name.format(expert=e), _matrix(data[e], t.type_name, shape[1:], None, keep_quantized, expert=True)
            continue
        if len(shape) == 2:
            rows = None if heads is None else unpermute_qk(np.arange(shape[0]), heads)
            matrix = _matrix(data, t.type_name, shape, rows, keep_quantized)
            if name.endswith(transposed):
                matrix = matrix.t() if isinstance(matrix, torch.Tensor) else TransposedKept(matrix)
            yield name, matrix
            continue
        w = _dequantize_raw(data, t.type_name).reshape(shape)
        if heads is not None:
            w = unpermute_qk(w, heads)
        elif norm_plus_one and name.endswith("norm.weight"):
            w = w - 1.0  # back to HF's offset-from-one form
        yield name, torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
    if dequantized:
        logger.info("dequantized to BF16 (no kernel keeps their type): %s", ", ".join(dequantized))


def _matrix(
    data: np.ndarray,
    type_name: str,
    shape: tuple[int, ...],
    rows: np.ndarray | None,
    keep_quantized: bool,
    expert: bool = False,
) -> KeptMatrix:
    # One matrix [N, K] (HF order), its rows reordered by `rows` if given; `expert`: a slice
    # of a 3-D expert stack (kept_gguf_tensor).
    if keep_quantized:
        return kept_gguf_tensor(data, type_name, (shape[0], shape[1]), rows, expert)
    w = _dequantize_raw(data, type_name).reshape(shape)
    if rows is not None:
        w = w[rows]
    return torch.from_numpy(np.array(w, dtype=np.float32, copy=True))


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
    index = index_from_headers(path)
    logger.info("read the tensor table of %s in %.2f s", path, time.perf_counter() - start)
    if os.path.isdir(cache_dir):  # else the metadata step writes it
        save_index(index, cache_dir)
    return index


def gguf_index(gguf_path: str) -> GGUFIndex:
    """The file's tensor table: from the metadata cache while the file (and its splits) are
    unchanged (path, size, mtime), else from its validated headers (once per process)."""
    path = os.path.realpath(gguf_path)
    st = os.stat(path)
    index = _gguf_index(path, st.st_size, st.st_mtime_ns)
    if index.splits and not index.matches_file():  # a split changed
        _gguf_index.cache_clear()
        index = index_from_headers(path)
    return index


def gguf_quant_types(gguf_path: str) -> set[str]:
    """The tensor types of a GGUF file's weights: its 2-D matrices and 3-D expert stacks
    (each expert's slice a matrix)."""
    index = gguf_index(gguf_path)
    return index.type_names(ndim=2) | index.type_names(ndim=3)


def check_gguf_quant_types(gguf_path: str) -> None:
    """ValueError naming the supported types unless a load can read every tensor of the file."""
    check_tensor_types(gguf_index(gguf_path).type_names(), gguf_path)


def estimated_weight_bytes(gguf_path: str, quantization: str, dtype_bytes: int) -> int:
    """Resident bytes of the file's weights once loaded with `quantization` (before loading:
    from the tensor table; gguf_quant.kept_bytes per matrix under "gguf")."""
    index = gguf_index(gguf_path)
    total = 0
    for t in index.tensors:
        if hf_tensor_name(t.name, index.architecture) is None:
            continue
        elements = int(np.prod(t.dims))
        if len(t.dims) < 2:
            total += elements * 4
        elif quantization == "gguf":
            total += kept_bytes(t.type_name, t.shape)
        elif quantization in ("int8", "int4"):  # 34 / 20 bytes per 32 (the tables at 8 bits)
            total += elements * (34 if quantization == "int8" or "token_embd" in t.name else 20) // 32
        else:
            total += elements * dtype_bytes
    return total


def read_gguf_quantized(gguf_path: str, hf_config: PretrainedConfig) -> Iterator[tuple[str, KeptTensor]]:
    """The file's weights with every matrix in its kept form (--quantization gguf)."""
    check_gguf_quant_types(gguf_path)
    yield from read_gguf_tensors(gguf_index(gguf_path), hf_config, keep_quantized=True)


def read_gguf_float(gguf_path: str, hf_config: PretrainedConfig) -> Iterator[tuple[str, KeptTensor]]:
    """The file's weights dequantized to float32 one tensor at a time (--quantization none,
    int8, int4: the model copies each into its dtype or requantizes it as it loads)."""
    check_gguf_quant_types(gguf_path)
    yield from read_gguf_tensors(gguf_index(gguf_path), hf_config, keep_quantized=False)
