"""Build an EngineCore from EngineArgs: the one construction path shared by the in-process
LLMEngine and the engine-core process behind the server."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
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
    from pagedllm.worker.kv_cache import kv_bytes_per_block, num_blocks_for_budget
    from pagedllm.worker.model_runner import ModelRunner

    t0 = time.monotonic()
    loaded = load_model(args.model, dtype=args.resolve_dtype(), max_model_len=args.max_model_len)
    model_config = loaded.model_config
    budget_config = args.create_engine_config(model_config, num_blocks=0).cache_config
    block_size = budget_config.block_size
    num_blocks = num_blocks_for_budget(model_config, block_size, budget_config.kv_cache_memory_bytes)
    check_kv_capacity(num_blocks, block_size, model_config.max_model_len, budget_config.kv_cache_memory_bytes)
    config = args.create_engine_config(model_config, num_blocks)
    kv_manager = KVCacheManager(
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=model_config.max_model_len,
        enable_caching=args.enable_prefix_caching,
        hash_extra_keys=(model_config.model, model_config.dtype, block_size),
    )
    scheduler = Scheduler(config.scheduler_config, kv_manager)
    runner = ModelRunner(loaded.model, model_config, block_size, num_blocks, seed=args.seed)
    pool_tokens = (num_blocks - 1) * block_size
    logger.info(
        "KV cache: %d blocks of %d tokens (%.1f MiB per block over %d layers, %s); "
        "%d tokens, max concurrency %.1fx at max_model_len=%d. Ready in %.1f s.",
        num_blocks - 1, block_size, kv_bytes_per_block(model_config, block_size) / 2**20,
        model_config.num_layers, model_config.dtype, pool_tokens,
        pool_tokens / model_config.max_model_len, model_config.max_model_len,
        time.monotonic() - t0,
    )
    return BuiltEngine(
        engine_core=EngineCore(scheduler, runner),
        scheduler=scheduler,
        tokenizer=loaded.tokenizer,
        model_config=model_config,
        config=config,
        model_dir=loaded.model_dir,
    )


def check_kv_capacity(num_blocks: int, block_size: int, max_model_len: int, budget: int) -> None:
    """Start-up fails unless the pool holds at least one request of max_model_len."""
    needed = -(-max_model_len // block_size)
    if num_blocks - 1 < needed:
        raise ValueError(
            f"the KV cache budget of {budget} bytes holds {max(num_blocks - 1, 0)} blocks of "
            f"{block_size} tokens, fewer than the {needed} blocks one request of "
            f"max_model_len={max_model_len} needs; raise kv_cache_memory_bytes "
            f"(--kv-cache-memory-bytes) or lower max_model_len (--max-model-len)"
        )
