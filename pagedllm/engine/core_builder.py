"""Build an EngineCore from an EngineConfig: the one construction path shared by the
in-process LLMEngine and the engine-core process behind the server. Each step is a small
function that takes the part of the configuration it needs."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from typing import Any

from pagedllm import faults
from pagedllm.config import EngineConfig, LoadConfig, ModelConfig, prefill_mode
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.generation_config import resolve_generation_defaults
from pagedllm.kv_backends import get_kv_backend
from pagedllm.kv_backends.base import KVBuild
from pagedllm.platforms.interface import MemoryProfile, Platform
from pagedllm.platforms.registry import get_platform
from pagedllm.reasoning import get_reasoning_parser
from pagedllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass
class BuiltEngine:
    engine_core: EngineCore
    scheduler: Scheduler
    tokenizer: Any
    model_config: ModelConfig
    config: EngineConfig
    """The engine's configuration with the model, the KV budget and num_blocks filled in."""
    model_dir: str
    """HF-format directory of the weights (GGUF: the converted cache)."""
    generation_defaults: dict[str, Any]
    """Sampling defaults from --generation-config (engine/generation_config.py)."""


def build_engine_core(config: EngineConfig) -> BuiltEngine:
    """Load the model, size the KV backend from the byte budget, and wire scheduler + runner.
    ``config`` comes from ``EngineArgs.create_engine_config`` (validated there)."""
    t0 = time.monotonic()
    platform = get_platform(config.device_config.device)
    configure_process(config, platform)
    executor = _create_executor(config) if config.parallel_config.tensor_parallel_size > 1 else None
    loaded = _load_model(config, platform, executor)
    config = _with_model(config, loaded, platform)
    kv = get_kv_backend(config.cache_config.kv_cache_backend).build(config, loaded)
    config = kv.config
    scheduler = _build_scheduler(config, kv)
    runner = _build_runner(config, loaded, kv)
    if executor is not None:  # rank 0 here, ranks 1..N-1 in workers (distributed/)
        runner = executor.start(runner, kv.block_size, kv.num_blocks)
    engine_core = EngineCore(
        scheduler, runner, _structured_output_manager(loaded, config.structured_output_config.reasoning_parser),
        kv_connector=_worker_connector(config, runner),
    )
    _log_ready(config, loaded, kv, platform, time.monotonic() - t0)
    return BuiltEngine(
        engine_core=engine_core,
        scheduler=scheduler,
        tokenizer=loaded.tokenizer,
        model_config=config.model_config,
        config=config,
        model_dir=loaded.model_dir,
        generation_defaults=resolve_generation_defaults(
            config.sampling_config.generation_config, config.sampling_config.override_generation_config,
            loaded.model_dir, loaded.gguf_path),
    )


def configure_process(config: EngineConfig, platform: Platform) -> None:
    """Process-wide settings from the configuration, before anything allocates: the
    platform's (malloc policy), the kernels' ISA level and switch, fault injection."""
    from pagedllm import kernels

    platform.prepare_process()
    kernels.set_compiled_kernels(config.attention_config.compiled_kernels)
    if config.device_config.cpu_isa is not None:
        kernels.set_cpu_isa(config.device_config.cpu_isa)
    faults.configure(config.observability_config.inject_fault)


def _load_model(config: EngineConfig, platform: Platform, executor: Any) -> Any:
    """The model (through the executor's rank 0 under tensor parallelism), with the
    activation precision, the decode path and the tokenizer the configuration names."""
    from pagedllm.models.loader import load_model, with_tokenizer

    load = config.load_config
    loaded = executor.load_model() if executor is not None else load_model(
        load.model, dtype=resolve_dtype(load, platform), max_model_len=load.max_model_len,
        quantization=load.quantization, revision=load.revision, download_dir=load.download_dir,
        device=config.device_config.device, hf_overrides=load.hf_overrides,
    )
    quant = config.quantization_config
    activations = prefill_mode(quant.matmul_activations)
    copies = True
    if activations == "bf16" and quant.bf16_copy_limit_bytes is not None:
        from pagedllm.layers.linear import bf16_copy_bytes_needed

        needed = bf16_copy_bytes_needed(loaded.model)
        if needed > quant.bf16_copy_limit_bytes:
            logger.info("bf16 weight copies would take %.1f MiB, past --matmul-activations auto's %.0f MiB: "
                        "kept weights multiply through bf16 panels decoded per call instead, float32 ones in "
                        "float32 (--matmul-activations bf16 makes the copies anyway)", needed / 2**20,
                        quant.bf16_copy_limit_bytes / 2**20)
            copies = False
    if activations != "float":
        from pagedllm.kernels.bf16_activations import bf16_copy_bytes
        from pagedllm.layers.linear import set_prefill_activations

        layers = set_prefill_activations(loaded.model, activations, copies=copies)
        panels = sum(bool(getattr(m, "bf16_panels", False)) for m in loaded.model.modules())
        logger.info("matmul activations %s on %d layers (%d through bf16 panels, no copy); bf16 weight copies "
                    "%.1f MiB (2 bytes a weight) beside the weights", activations, layers, panels,
                    bf16_copy_bytes(loaded.model) / 2**20)
    else:
        logger.info("matmul activations float32")
    _set_fused_decode(loaded.model, config.attention_config.fused_decode)
    if load.tokenizer is not None:
        loaded = with_tokenizer(loaded, load.tokenizer)
    return loaded


def resolve_dtype(load: LoadConfig, platform: Platform) -> str:
    """The compute dtype: the one asked for, else the platform's for these weights."""
    from pagedllm.models.loader import keeps_quantized_weights

    if load.dtype != "auto":
        return load.dtype
    return platform.resolve_dtype("auto", keeps_quantized_weights(load.model, load.quantization))


def _set_fused_decode(model: Any, enabled: bool) -> None:
    from pagedllm.models.fused_decode import FusedDecoderLayers

    for module in model.modules():
        if isinstance(module, FusedDecoderLayers):
            module.enabled = enabled


def _with_model(config: EngineConfig, loaded: Any, platform: Platform) -> EngineConfig:
    """``config`` with the loaded model's description and the platform's KV budget."""
    model_config = _with_pooling(config, loaded)
    sched = dataclasses.replace(config.scheduler_config, max_model_len=model_config.max_model_len)
    cache = config.cache_config
    from pagedllm.models.pooling import is_bidirectional

    if is_bidirectional(loaded.model):
        # Each prompt runs whole in one step, and no prefix is shared (bidirectional states
        # depend on the tokens after them).
        sched = dataclasses.replace(sched, whole_prompts=True,
                                    max_num_batched_tokens=max(sched.max_num_batched_tokens, model_config.max_model_len))
        cache = dataclasses.replace(cache, enable_prefix_caching=False)
    config = dataclasses.replace(config, model_config=model_config, scheduler_config=sched, cache_config=cache)
    budget = platform.kv_cache_budget(config, functools.partial(_profile_memory, config, loaded))
    return dataclasses.replace(
        config, cache_config=dataclasses.replace(config.cache_config, kv_cache_memory_bytes=budget))


def _with_pooling(config: EngineConfig, loaded: Any) -> ModelConfig:
    """The model's description with its runner and resolved pooling (models/pooling.py)."""
    from pagedllm.models.pooling import resolve_pooling
    from pagedllm.models.registry import family_of

    pooling = config.pooling_config
    model_config = loaded.model_config
    family = family_of(model_config.architecture)
    runner, pooler = resolve_pooling(
        loaded.model, family.runner, loaded.model_dir, pooling.runner, pooling.convert, pooling.pooler)
    if hasattr(loaded.model, "sep_token_id"):  # BERT's token types (models/bert.py)
        loaded.model.sep_token_id = getattr(loaded.tokenizer, "sep_token_id", None)
    num_labels = getattr(loaded.hf_config, "num_labels", None) if hasattr(loaded.model, "classify") else None
    id2label = getattr(loaded.hf_config, "id2label", None) or {}
    labels = tuple(str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(num_labels or 0))
    if runner == "pooling":
        logger.info("pooling model: %s pooling, normalize=%s%s", pooler.pooling_type, pooler.normalize,
                    f", {num_labels} labels" if num_labels else "")
    return dataclasses.replace(model_config, runner=runner, pooler=pooler, num_labels=num_labels, labels=labels)


def _profile_memory(config: EngineConfig, loaded: Any) -> MemoryProfile:
    """One profiled forward at the step's largest shape, for a platform's budget rule."""
    from pagedllm.worker.memory_profile import profile_device_memory

    sched = config.scheduler_config
    return profile_device_memory(
        loaded.model, loaded.model_config, sched.max_num_batched_tokens, sched.max_num_seqs,
        config.cache_config.block_size, config.attention_config, config.device_config.device,
    )


def _build_scheduler(config: EngineConfig, kv: KVBuild) -> Scheduler:
    transfer = config.kv_transfer_config
    connector = None
    if transfer is not None:
        from pagedllm.distributed.kv_transfer.zmq_connector import ZmqConnectorScheduler

        connector = ZmqConnectorScheduler(transfer, kv.block_size)
    return Scheduler(
        config.scheduler_config, kv.manager, kv_connector=connector,
        kv_load_failure_policy=transfer.kv_load_failure_policy if transfer is not None else "recompute",
        speculative_config=config.speculative_config,
        max_loras=config.lora_config.max_loras if config.lora_config is not None else None,
    )


def _build_runner(config: EngineConfig, loaded: Any, kv: KVBuild) -> Any:
    from pagedllm.worker.model_runner import ModelRunner

    return ModelRunner(
        loaded.model, loaded.model_config, kv.block_size, kv.num_blocks, seed=config.seed,
        make_kv_worker=kv.make_worker, speculative_config=config.speculative_config,
        attention_config=config.attention_config,
        decode_graph_sizes=config.device_config.cuda_graph_sizes,
        lora_config=config.lora_config,
        pooler_config=config.model_config.pooler if config.model_config is not None else None,
        encoder_cache_size=config.multimodal_config.encoder_cache_size or config.scheduler_config.max_num_batched_tokens,
    )


def _worker_connector(config: EngineConfig, runner: Any) -> Any:
    if config.kv_transfer_config is None:
        return None
    from pagedllm.distributed.kv_transfer.zmq_worker import ZmqConnectorWorker

    return ZmqConnectorWorker(config.kv_transfer_config, runner.kv_caches)


def _log_ready(config: EngineConfig, loaded: Any, kv: KVBuild, platform: Platform, seconds: float) -> None:
    logger.info(
        "weights: %.1f MiB resident (quantization=%s); KV cache budget %.1f MiB of the "
        "%.1f MiB of memory free after loading; platform %s",
        loaded.weight_bytes / 2**20, loaded.quantization,
        (config.cache_config.kv_cache_memory_bytes or 0) / 2**20, platform.free_memory_bytes() / 2**20,
        platform.describe(),
    )
    logger.info("%s Ready in %.1f s.", kv.summary, seconds)


def _create_executor(config: EngineConfig) -> Any:
    """The tensor-parallel executor (the configuration was checked for what runs across
    ranks, engine/config_checks.py)."""
    from pagedllm.distributed.executors import create_executor
    from pagedllm.distributed.worker import ModelLoadSpec

    load = config.load_config
    dtype = resolve_dtype(load, get_platform(config.device_config.device))
    spec = ModelLoadSpec(load.model, dtype, load.max_model_len, load.quantization,  # type: ignore[arg-type]
                         config.seed, load.revision, load.download_dir)
    return create_executor(config.parallel_config, spec)


def _structured_output_manager(loaded: Any, reasoning_parser: str | None) -> StructuredOutputManager:
    """With a reasoning parser, grammars start after the reasoning (its end marker's token ids
    in this tokenizer)."""
    model_config = loaded.model_config
    reasoning = None
    if reasoning_parser is not None:
        reasoning = get_reasoning_parser(reasoning_parser)(loaded.tokenizer)
        logger.info("reasoning parser %s: grammars start after %s (token ids %s)",
                    reasoning_parser, reasoning.end_marker, list(reasoning.end_token_ids))
    return StructuredOutputManager(
        loaded.tokenizer, model_config.vocab_size, model_config.eos_token_ids, reasoning=reasoning
    )
