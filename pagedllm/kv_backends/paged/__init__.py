"""The paged KV backend: a pool of fixed-size blocks, block tables, prefix caching, forks.

Its parts, torch-free (the control plane): block_pool.py (the ref-counted blocks and the
LRU free queue), kv_cache_utils.py (prefix-cache hashing), manager.py (``KVCacheManager``:
block tables, prefix cache, copy-on-write), offload.py (the KV offload tiers behind the
prefix cache: host memory and disk), saved_kv.py (prefixes saved by name), view.py (the
dashboard's block map); with torch: worker.py (the pool's tensors, ``PagedKVWorker``: block
tables and slot mappings, the copies to and from the offload tiers), imported only by
``build`` and the worker processes. Registered as "paged".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pagedllm.kv_backends.paged.manager import KVCacheGroupSpec, KVCacheManager
from pagedllm.core.kv_manager import KVManager
from pagedllm.kv_backends.base import KVBackend, KVBuild
from pagedllm.kv_backends.paged.view import PagedKVView, take_paged_view

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.request import Request


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


def _group_specs(config: EngineConfig, layers: Sequence[Any]) -> list[KVCacheGroupSpec]:
    """Equal-sized KV cache groups per attention type (full, sliding window); a block spans
    one layer slice per layer of a group (worker.py). KV transfer needs one group."""
    from pagedllm.kv_backends.paged.worker import kv_cache_groups

    group_specs = [KVCacheGroupSpec(g.sliding_window) for g in kv_cache_groups(layers)]
    if config.kv_transfer_config is not None and (
        not config.cache_config.enable_prefix_caching or len(group_specs) != 1
    ):
        raise ValueError(
            "--kv-transfer-config needs prefix caching (blocks travel under their prefix-cache "
            "hashes) and a model with one KV cache group (no sliding-window layers)"
        )
    return group_specs


def _summary(manager: KVCacheManager, layer_slots: int, storage: str, group_specs: list[KVCacheGroupSpec]) -> str:
    """The start-up line: the pool, and the requests of max_model_len tokens (decoding) that
    fit at once, over all KV groups."""
    num_blocks, block_size, max_len = manager.num_blocks, manager.block_size, manager.max_model_len
    max_concurrency = (num_blocks - 1) / manager.max_blocks_per_request(max_len)
    return (
        f"KV cache: {num_blocks - 1} blocks of {block_size} tokens "
        f"({manager.bytes_per_block / 2**20:.1f} MiB per block over {layer_slots} layers, "
        f"KV {storage}), group windows {[g.sliding_window for g in group_specs]}; "
        f"{(num_blocks - 1) * block_size} token slots, max concurrency {max_concurrency:.1f}x "
        f"at max_model_len={max_len}."
    )


def _offload_store(
    config: EngineConfig, loaded: Any, manager: KVCacheManager, layers: Sequence[Any], layer_slots: int, storage: str
) -> Any:
    """The KV offload tiers (offload.py) behind the manager's prefix cache; ValueError naming
    what they cannot run with."""
    import glob
    import os

    from pagedllm.kv_backends.paged.offload import BlockGeometry, OffloadStore, engine_namespace
    from pagedllm.layers.kv_quant import row_bytes, row_width

    cache = config.cache_config
    if manager.num_groups != 1:  # the rest is refused before the model loads (KVBackend.check_config)
        raise ValueError("the KV offload tiers (--kv-offload-cpu-bytes, --kv-offload-dir) do not run with a "
                         "model with sliding-window layers (more than one KV cache group) yet")
    model_config = loaded.model_config
    head_dim = layers[0].head_dim
    geometry = BlockGeometry(
        layers=layer_slots, kv_heads=layers[0].num_kv_heads, head_size=row_width(storage, head_dim),
        block_size=cache.block_size, dtype=storage, row_bytes=row_bytes(storage, head_dim),
    )
    gguf = getattr(loaded, "gguf_path", None)
    weight_files = [gguf] if gguf else sorted(glob.glob(os.path.join(loaded.model_dir, "*.safetensors")))
    namespace = engine_namespace(
        weight_files, geometry,
        (manager.hash_extra_keys, config.quantization_config.matmul_activations),
    )
    store = OffloadStore(geometry, namespace, cache.kv_offload_cpu_bytes, cache.kv_offload_dir,
                         cache.kv_offload_disk_bytes)
    manager.set_offload(store)
    return store


class PagedBackend(KVBackend):
    name = "paged"
    capabilities = KVCacheManager.capabilities

    def build(self, config: EngineConfig, loaded: Any) -> KVBuild:
        from pagedllm.config import resolve_kv_cache_dtype
        from pagedllm.kv_backends.paged.worker import (
            PagedKVWorker,
            attention_layers,
            kv_bytes_per_block,
            num_blocks_for_budget,
            num_layer_slots,
        )

        model_config = loaded.model_config
        cache = config.cache_config
        block_size = cache.block_size
        layers = attention_layers(loaded.model)
        group_specs = _group_specs(config, layers)
        layer_slots = num_layer_slots(layers)
        budget = cache.kv_cache_memory_bytes
        assert budget is not None, "the platform sets the budget before the build"
        storage = resolve_kv_cache_dtype(cache.kv_cache_dtype, model_config.dtype)
        num_blocks = num_blocks_for_budget(model_config, block_size, budget, layer_slots, cache.kv_cache_dtype)
        config = dataclasses.replace(config, num_blocks=num_blocks)
        manager = KVCacheManager(
            num_blocks=num_blocks,
            block_size=block_size,
            max_model_len=model_config.max_model_len,
            enable_caching=cache.enable_prefix_caching,
            # The KV storage dtype: blocks of int8 codes are not blocks of floats.
            hash_extra_keys=(model_config.model, model_config.dtype, block_size, ("kv_cache_dtype", storage),
                             loaded.quantization),
            group_specs=group_specs,
        )
        max_len = model_config.max_model_len
        needed = manager.max_blocks_per_request(max_len, config.scheduler_config.max_num_batched_tokens)
        check_kv_capacity(num_blocks, needed, block_size, max_len, budget)
        manager.bytes_per_block = kv_bytes_per_block(model_config, block_size, layer_slots, cache.kv_cache_dtype)
        manager.bytes_per_token = kv_bytes_per_block(model_config, 1, len(layers), cache.kv_cache_dtype)
        device = config.device_config.device
        offload = _offload_store(config, loaded, manager, layers, layer_slots, storage) if cache.kv_offload else None
        return KVBuild(
            manager=manager,
            config=config,
            make_worker=lambda layers: PagedKVWorker(layers, num_blocks, block_size, storage, device, offload),
            block_size=block_size,
            num_blocks=num_blocks,
            summary=_summary(manager, layer_slots, storage, group_specs),
        )

    def view(self, manager: KVManager, running: Sequence[Request]) -> PagedKVView:
        assert isinstance(manager, KVCacheManager), type(manager)
        return take_paged_view(manager, running)


BACKEND = PagedBackend()
