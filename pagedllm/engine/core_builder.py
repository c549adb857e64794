"""Build an EngineCore from EngineArgs: the one construction path shared by the in-process
LLMEngine and the engine-core process behind the server."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.generation_config import resolve_generation_defaults
from pagedllm.kv_backends import get_kv_backend
from pagedllm.malloc_policy import keep_freed_memory
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
    model_dir: str
    """HF-format directory of the weights (GGUF: the converted cache)."""
    generation_defaults: dict[str, Any]
    """Sampling defaults from --generation-config (engine/generation_config.py)."""


def build_engine_core(args: EngineArgs) -> BuiltEngine:
    """Load the model, size the KV backend from the byte budget, and wire scheduler + runner."""
    from pagedllm.kernels.bf16_activations import bf16_copy_bytes, resolve_matmul_activations
    from pagedllm.models.loader import load_model
    from pagedllm.worker.model_runner import ModelRunner

    t0 = time.monotonic()
    # "auto" resolved once, so every later reader of the arguments sees the same device.
    args = dataclasses.replace(args, device=args.resolve_device())
    if args.device == "cpu" and keep_freed_memory():  # before the model and KV cache allocate
        logger.debug("glibc keeps freed memory for reuse (malloc_policy.py)")
    # Settings that cannot work together fail before the model loads.
    args.device_config()
    args.check_device_support()
    CacheConfig(enable_prefix_caching=args.resolve_prefix_caching(), kv_cache_backend=args.kv_cache_backend,
                kv_cache_dtype=args.kv_cache_dtype)  # type: ignore[arg-type]
    kv_backend = get_kv_backend(args.kv_cache_backend)
    kv_backend.check_args(args, args.resolve_prefix_caching())
    matmul_activations = resolve_matmul_activations(args.matmul_activations, args.device, args.tensor_parallel_size)
    if matmul_activations != "float" and args.tensor_parallel_size > 1:
        raise ValueError(
            f"--matmul-activations {args.matmul_activations} runs in one process only (--tensor-parallel-size 1)")
    executor = None
    if args.tensor_parallel_size > 1:  # rank 0 here, ranks 1..N-1 in workers (distributed/)
        executor = _create_executor(args)
    loaded = executor.load_model() if executor is not None else load_model(
        args.model,
        dtype=args.resolve_dtype(),
        max_model_len=args.max_model_len,
        quantization=args.quantization,
        revision=args.revision,
        download_dir=args.download_dir,
        device=args.device,
    )
    if matmul_activations != "float":
        from pagedllm.layers.linear import set_prefill_activations

        layers = set_prefill_activations(loaded.model, matmul_activations)
        logger.info("matmul activations %s (--matmul-activations %s) on %d layers; bf16 weight copies "
                    "%.1f MiB (2 bytes a weight) beside the weights", matmul_activations, args.matmul_activations,
                    layers, bf16_copy_bytes(loaded.model) / 2**20)
    else:
        logger.info("matmul activations float32 (--matmul-activations %s)", args.matmul_activations)
    if args.tokenizer is not None:
        from pagedllm.models.loader import with_tokenizer

        loaded = with_tokenizer(loaded, args.tokenizer)
    generation_defaults = resolve_generation_defaults(
        args.generation_config, args.override_generation_config, loaded.model_dir, loaded.gguf_path)
    model_config = loaded.model_config
    if args.device == "cuda" and args.kv_cache_memory_bytes is None:
        args = dataclasses.replace(args, kv_cache_memory_bytes=_cuda_kv_budget(args, loaded))
    kv = kv_backend.build(args, loaded)
    config = kv.config
    transfer_config = args.parse_kv_transfer_config()
    lora_config = args.lora_config()
    scheduler_connector = None
    if transfer_config is not None:
        from pagedllm.distributed.kv_transfer.zmq_connector import ZmqConnectorScheduler

        scheduler_connector = ZmqConnectorScheduler(transfer_config, kv.block_size)
    scheduler = Scheduler(
        config.scheduler_config, kv.manager, kv_connector=scheduler_connector,
        kv_load_failure_policy=transfer_config.kv_load_failure_policy if transfer_config is not None else "recompute",
        speculative_config=config.speculative_config,
        max_loras=lora_config.max_loras if lora_config is not None else None,
    )
    runner = ModelRunner(
        loaded.model, model_config, kv.block_size, kv.num_blocks, seed=args.seed,
        make_kv_worker=kv.make_worker, speculative_config=config.speculative_config,
        attention_config=config.attention_config,
        decode_graph_sizes=config.device_config.cuda_graph_sizes,
        lora_config=lora_config,
    )
    if executor is not None:
        runner = executor.start(runner, kv.block_size, kv.num_blocks)
    worker_connector = None
    if transfer_config is not None:
        from pagedllm.distributed.kv_transfer.zmq_worker import ZmqConnectorWorker

        worker_connector = ZmqConnectorWorker(transfer_config, runner.kv_caches)
    free_bytes = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if args.device == "cuda":
        import torch

        free_bytes = torch.cuda.mem_get_info()[0]
    logger.info(
        "weights: %.1f MiB resident (quantization=%s); KV cache budget %.1f MiB of the "
        "%.1f MiB of memory free after loading",
        loaded.weight_bytes / 2**20, loaded.quantization,
        config.cache_config.kv_cache_memory_bytes / 2**20, free_bytes / 2**20,
    )
    logger.info("%s Ready in %.1f s.", kv.summary, time.monotonic() - t0)
    return BuiltEngine(
        engine_core=EngineCore(
            scheduler, runner, _structured_output_manager(loaded, args.reasoning_parser),
            kv_connector=worker_connector,
        ),
        scheduler=scheduler,
        tokenizer=loaded.tokenizer,
        model_config=model_config,
        config=config,
        model_dir=loaded.model_dir,
        generation_defaults=generation_defaults,
    )


def _cuda_kv_budget(args: EngineArgs, loaded: Any) -> int:
    """The KV budget from gpu_memory_utilization: a profiled forward at the step's largest
    shape, then what it leaves of the allowance (worker/memory_profile.py)."""
    import torch

    from pagedllm.worker.memory_profile import kv_budget_from_utilization, profile_cuda_memory

    config = args.create_engine_config(loaded.model_config, num_blocks=0)
    sched = config.scheduler_config
    profile = profile_cuda_memory(
        loaded.model, loaded.model_config, sched.max_num_batched_tokens, sched.max_num_seqs,
        config.cache_config.block_size, config.attention_config, torch.device("cuda"),
    )
    utilization = config.device_config.memory_utilization
    budget = kv_budget_from_utilization(profile, utilization)
    logger.info(
        "KV cache budget %.0f MiB: gpu_memory_utilization=%s of %.0f MiB, less a %.0f MiB peak",
        budget / 2**20, utilization, profile.total_bytes / 2**20, profile.peak_bytes / 2**20,
    )
    return budget


def _create_executor(args: EngineArgs) -> Any:
    """The tensor-parallel executor for ``args`` (refusing what does not run across ranks)."""
    from pagedllm.distributed.executor import check_parallel_support
    from pagedllm.distributed.executors import create_executor
    from pagedllm.distributed.worker import ModelLoadSpec

    parallel = ParallelConfig(args.tensor_parallel_size, args.distributed_executor_backend)
    check_parallel_support(
        parallel, speculative=args.speculative_config is not None, kv_transfer=args.kv_transfer_config is not None
    )
    load = ModelLoadSpec(
        args.model, args.resolve_dtype(), args.max_model_len, args.quantization, args.seed,
        args.revision, args.download_dir,
    )
    return create_executor(parallel, load)


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
