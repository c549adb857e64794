"""Build an EngineCore from EngineArgs: the one construction path shared by the in-process
LLMEngine and the engine-core process behind the server."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, parse_bytes
from pagedllm.core.kv_cache_manager import KVCacheGroupSpec, KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.engine_core import EngineCore
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


def build_engine_core(args: EngineArgs) -> BuiltEngine:
    """Load the model, size the KV pool from the byte budget, and wire scheduler + runner."""
    from pagedllm.models.loader import load_model
    from pagedllm.worker.kv_cache import (
        attention_layers,
        kv_bytes_per_block,
        kv_cache_groups,
        num_blocks_for_budget,
        num_layer_slots,
    )
    from pagedllm.worker.model_runner import ModelRunner

    t0 = time.monotonic()
    # Settings that cannot work together fail before the model loads.
    CacheConfig(enable_prefix_caching=args.resolve_prefix_caching(), kv_cache_backend=args.kv_cache_backend)
    executor = None
    if args.tensor_parallel_size > 1:  # rank 0 here, ranks 1..N-1 in workers (distributed/)
        executor = _create_executor(args)
    loaded = executor.load_model() if executor is not None else load_model(
        args.model,
        dtype=args.resolve_dtype(),
        max_model_len=args.max_model_len,
        quantization=args.quantization,
    )
    model_config = loaded.model_config
    budget_config = args.create_engine_config(model_config, num_blocks=0).cache_config
    if budget_config.kv_cache_backend == "vattention":
        return _build_vattention(args, loaded, t0)
    block_size = budget_config.block_size
    # Equal-sized KV cache groups per attention type (full, sliding window); a block spans
    # one layer slice per layer of a group (worker/kv_cache.py).
    layers = attention_layers(loaded.model)
    group_specs = [KVCacheGroupSpec(g.sliding_window) for g in kv_cache_groups(layers)]
    layer_slots = num_layer_slots(layers)
    num_blocks = num_blocks_for_budget(model_config, block_size, budget_config.kv_cache_memory_bytes, layer_slots)
    config = args.create_engine_config(model_config, num_blocks)
    kv_manager = KVCacheManager(
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=model_config.max_model_len,
        enable_caching=budget_config.enable_prefix_caching,
        hash_extra_keys=(model_config.model, model_config.dtype, block_size, loaded.quantization),
        group_specs=group_specs,
    )
    max_len = model_config.max_model_len
    check_kv_capacity(
        num_blocks,
        kv_manager.max_blocks_per_request(max_len, config.scheduler_config.max_num_batched_tokens),
        block_size,
        max_len,
        budget_config.kv_cache_memory_bytes,
    )
    kv_manager.bytes_per_block = kv_bytes_per_block(model_config, block_size, layer_slots)
    kv_manager.bytes_per_token = kv_bytes_per_block(model_config, 1, len(layers))
    transfer_config = args.parse_kv_transfer_config()
    scheduler_connector = None
    if transfer_config is not None:
        from pagedllm.distributed.kv_transfer.zmq_connector import ZmqConnectorScheduler

        if not args.resolve_prefix_caching() or len(group_specs) != 1:
            raise ValueError(
                "--kv-transfer-config needs prefix caching (blocks travel under their prefix-cache "
                "hashes) and a model with one KV cache group (no sliding-window layers)"
            )
        scheduler_connector = ZmqConnectorScheduler(transfer_config, block_size)
    scheduler = Scheduler(
        config.scheduler_config, kv_manager, kv_connector=scheduler_connector,
        kv_load_failure_policy=transfer_config.kv_load_failure_policy if transfer_config is not None else "recompute",
        speculative_config=config.speculative_config,
    )
    runner = ModelRunner(
        loaded.model, model_config, block_size, num_blocks, seed=args.seed,
        speculative_config=config.speculative_config,
    )
    if executor is not None:
        runner = executor.start(runner, block_size, num_blocks)
    worker_connector = None
    if transfer_config is not None:
        from pagedllm.distributed.kv_transfer.zmq_worker import ZmqConnectorWorker

        worker_connector = ZmqConnectorWorker(transfer_config, runner.kv_caches)
    # Requests of max_model_len tokens (decoding) that fit at once, over all KV groups.
    max_concurrency = (num_blocks - 1) / kv_manager.max_blocks_per_request(max_len)
    free_bytes = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    logger.info(
        "weights: %.1f MiB resident (quantization=%s); KV cache budget %.1f MiB of the "
        "%.1f MiB of memory free after loading",
        loaded.weight_bytes / 2**20, loaded.quantization,
        budget_config.kv_cache_memory_bytes / 2**20, free_bytes / 2**20,
    )
    logger.info(
        "KV cache: %d blocks of %d tokens (%.1f MiB per block over %d layers, %s), "
        "group windows %s; %d token slots, max concurrency %.1fx at max_model_len=%d. "
        "Ready in %.1f s.",
        num_blocks - 1, block_size, kv_bytes_per_block(model_config, block_size, layer_slots) / 2**20,
        layer_slots, model_config.dtype, [g.sliding_window for g in group_specs],
        (num_blocks - 1) * block_size, max_concurrency, max_len, time.monotonic() - t0,
    )
    return BuiltEngine(
        engine_core=EngineCore(
            scheduler, runner, _structured_output_manager(loaded), kv_connector=worker_connector
        ),
        scheduler=scheduler,
        tokenizer=loaded.tokenizer,
        model_config=model_config,
        config=config,
        model_dir=loaded.model_dir,
    )


def _build_vattention(args: EngineArgs, loaded: Any, t0: float) -> BuiltEngine:
    """The vattention backend: per layer, K and V regions of max_num_seqs slots reserved
    (worker/vattention_kv.py); the same page budget kept by VAttentionKVManager."""
    from pagedllm.core.vattention_manager import VAttentionKVManager, vattention_layout
    from pagedllm.worker.kv_cache import _DTYPE_BYTES, attention_layers
    from pagedllm.worker.model_runner import ModelRunner, VAttentionLayout
    from pagedllm.worker.vattention_kv import HUGE, SMALL_PAGE

    if args.speculative_config is not None:
        raise ValueError(
            "--speculative-config is not supported with --kv-cache-backend vattention yet (drafts "
            "need lookahead slots and rollback, built for the paged backend); use the paged backend"
        )
    if args.kv_transfer_config is not None:
        raise ValueError(
            "--kv-transfer-config is not supported with --kv-cache-backend vattention (blocks "
            "travel under prefix-cache hashes, which vattention slots do not have); use the paged backend"
        )
    model_config = loaded.model_config
    layers = attention_layers(loaded.model)
    token_bytes = model_config.num_kv_heads * model_config.head_dim * _DTYPE_BYTES[model_config.dtype]
    max_len = model_config.max_model_len
    capacity = vattention_layout(token_bytes, max_len, HUGE)
    page_bytes = HUGE if args.vattention_hugepages else SMALL_PAGE
    budget = parse_bytes(args.kv_cache_memory_bytes)
    num_pages = budget // page_bytes
    config = args.create_engine_config(model_config, num_blocks=num_pages + 1)
    num_slots = config.scheduler_config.max_num_seqs
    kv_manager = VAttentionKVManager(
        num_pages=num_pages,
        page_bytes=page_bytes,
        token_bytes=token_bytes,
        num_regions=2 * len(layers),
        num_slots=num_slots,
        slot_capacity=capacity,
        max_model_len=max_len,
        deferred_reclaim=args.vattention_deferred_reclaim,
    )
    needed = kv_manager.max_blocks_per_request(max_len)
    if num_pages < needed:
        raise ValueError(
            f"the KV cache budget of {budget} bytes holds {num_pages} pages of {page_bytes} bytes, "
            f"fewer than the {needed} pages one request of max_model_len={max_len} needs with the "
            f"vattention backend; raise kv_cache_memory_bytes (--kv-cache-memory-bytes) or lower "
            f"max_model_len (--max-model-len)"
        )
    scheduler = Scheduler(config.scheduler_config, kv_manager)
    layout = VAttentionLayout(num_slots, capacity, args.vattention_hugepages)
    runner = ModelRunner(loaded.model, model_config, 1, 0, seed=args.seed, vattention=layout)
    logger.info(
        "KV cache (vattention): %d slots x %d tokens reserved (%.1f GiB of address space over %d "
        "layers, %s); budget %d pages of %d KiB%s, max concurrency %.1fx at max_model_len=%d. "
        "Ready in %.1f s.",
        num_slots, capacity, 2 * len(layers) * num_slots * capacity * token_bytes / 2**30, len(layers),
        model_config.dtype, num_pages, page_bytes // 1024,
        " (transparent huge pages)" if args.vattention_hugepages else "",
        num_pages / needed, max_len, time.monotonic() - t0,
    )
    return BuiltEngine(
        engine_core=EngineCore(scheduler, runner, _structured_output_manager(loaded)),
        scheduler=scheduler,
        tokenizer=loaded.tokenizer,
        model_config=model_config,
        config=config,
        model_dir=loaded.model_dir,
    )


def _create_executor(args: EngineArgs) -> Any:
    """The tensor-parallel executor for ``args`` (refusing what does not run across ranks)."""
    from pagedllm.distributed.executor import check_parallel_support
    from pagedllm.distributed.executors import create_executor
    from pagedllm.distributed.worker import ModelLoadSpec

    parallel = ParallelConfig(args.tensor_parallel_size, args.distributed_executor_backend)
    check_parallel_support(
        parallel, kv_cache_backend=args.kv_cache_backend,
        speculative=args.speculative_config is not None, kv_transfer=args.kv_transfer_config is not None,
    )
    load = ModelLoadSpec(args.model, args.resolve_dtype(), args.max_model_len, args.quantization, args.seed)
    return create_executor(parallel, load)


def _structured_output_manager(loaded: Any) -> StructuredOutputManager:
    model_config = loaded.model_config
    return StructuredOutputManager(loaded.tokenizer, model_config.vocab_size, model_config.eos_token_ids)


def check_kv_capacity(
    num_blocks: int, needed: int, block_size: int, max_model_len: int, budget: int
) -> None:
    """Start-up fails unless the pool holds at least one request of max_model_len
    (`needed` blocks, summed over the KV cache groups)."""
    if num_blocks - 1 < needed:
        raise ValueError(
            f"the KV cache budget of {budget} bytes holds {max(num_blocks - 1, 0)} blocks of "
            f"{block_size} tokens, fewer than the {needed} blocks one request of "
            f"max_model_len={max_model_len} needs; raise kv_cache_memory_bytes "
            f"(--kv-cache-memory-bytes) or lower max_model_len (--max-model-len)"
        )
