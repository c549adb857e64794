"""Build an EngineCore from EngineArgs: the one construction path shared by the in-process
LLMEngine and the engine-core process behind the server."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.core.kv_cache_manager import KVCacheGroupSpec, KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.engine_core import EngineCore

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
    loaded = load_model(args.model, dtype=args.resolve_dtype(), max_model_len=args.max_model_len)
    model_config = loaded.model_config
    budget_config = args.create_engine_config(model_config, num_blocks=0).cache_config
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
        enable_caching=args.enable_prefix_caching,
        hash_extra_keys=(model_config.model, model_config.dtype, block_size),
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
    scheduler = Scheduler(config.scheduler_config, kv_manager, config.speculative_config)
    runner = ModelRunner(
        loaded.model, model_config, block_size, num_blocks, seed=args.seed,
        speculative_config=config.speculative_config,
    )
    # Requests of max_model_len tokens (decoding) that fit at once, over all KV groups.
    max_concurrency = (num_blocks - 1) / kv_manager.max_blocks_per_request(max_len)
    logger.info(
        "KV cache: %d blocks of %d tokens (%.1f MiB per block over %d layers, %s), "
        "group windows %s; %d token slots, max concurrency %.1fx at max_model_len=%d. "
        "Ready in %.1f s.",
        num_blocks - 1, block_size, kv_bytes_per_block(model_config, block_size, layer_slots) / 2**20,
        layer_slots, model_config.dtype, [g.sliding_window for g in group_specs],
        (num_blocks - 1) * block_size, max_concurrency, max_len, time.monotonic() - t0,
    )
    return BuiltEngine(
        engine_core=EngineCore(scheduler, runner),
        scheduler=scheduler,
        tokenizer=loaded.tokenizer,
        model_config=model_config,
        config=config,
        model_dir=loaded.model_dir,
    )


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
