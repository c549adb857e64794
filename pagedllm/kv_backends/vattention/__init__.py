"""The vattention KV backend (arXiv 2405.04437): each request's KV is virtually contiguous
in a reserved slot, backed by physical pages only as it grows.

Its parts: manager.py (the control plane: slots and the page budget), worker.py (the
reserved mapping and the contiguous-slot attention metadata), view.py (reserved and resident
pages per request for the dashboard). No page is shared between slots, so there is no prefix
caching and no fork (n > 1, beam search). Registered as "vattention".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pagedllm.core.kv_manager import KVManager
from pagedllm.kv_backends.base import KVBackend, KVBuild
from pagedllm.kv_backends.vattention.manager import FORK_UNSUPPORTED, VAttentionKVManager, vattention_layout
from pagedllm.kv_backends.vattention.view import SlotKVView, take_slot_view

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.request import Request


def _check_capacity(manager: VAttentionKVManager, budget: int) -> int:
    """The pages one request of max_model_len needs; ValueError when the budget holds fewer."""
    max_len = manager.max_model_len
    needed = manager.max_blocks_per_request(max_len)
    if manager.num_pages < needed:
        raise ValueError(
            f"the KV cache budget of {budget} bytes holds {manager.num_pages} pages of {manager.page_bytes} "
            f"bytes, fewer than the {needed} pages one request of max_model_len={max_len} needs with the "
            f"vattention backend; raise kv_cache_memory_bytes (--kv-cache-memory-bytes) or lower "
            f"max_model_len (--max-model-len)"
        )
    return needed


class VAttentionBackend(KVBackend):
    name = "vattention"
    capabilities = VAttentionKVManager.capabilities
    supports_speculation = False
    supports_tensor_parallel = False
    needs_host_memory = True
    fork_refusal = FORK_UNSUPPORTED

    def build(self, config: EngineConfig, loaded: Any) -> KVBuild:
        """Per layer, K and V regions of max_num_seqs slots reserved (worker.py); the page
        budget kept by ``VAttentionKVManager``."""
        from pagedllm.kv_backends.vattention.worker import HUGE, SMALL_PAGE, VAttentionKVCache
        from pagedllm.config import resolve_kv_cache_dtype
        from pagedllm.kv_backends.model_kv import attention_layers, kv_token_bytes

        model_config = loaded.model_config
        layers = attention_layers(loaded.model)
        # A quantized cache keeps a scale per (token, head) row, as the paged one
        # (layers/kv_quant.py): the contiguous slots need no block-sized spans for it.
        cache = config.cache_config
        storage = resolve_kv_cache_dtype(cache.kv_cache_dtype, model_config.dtype)
        token_bytes = kv_token_bytes(model_config, cache.kv_cache_dtype)
        max_len = model_config.max_model_len
        capacity = vattention_layout(token_bytes, max_len, HUGE)
        hugepages = cache.vattention_hugepages
        page_bytes = HUGE if hugepages else SMALL_PAGE
        budget = cache.kv_cache_memory_bytes
        assert budget is not None, "the platform sets the budget before the build"
        num_pages = budget // page_bytes
        config = dataclasses.replace(config, num_blocks=num_pages + 1)
        num_slots = config.scheduler_config.max_num_seqs
        manager = VAttentionKVManager(
            num_pages=num_pages,
            page_bytes=page_bytes,
            token_bytes=token_bytes,
            num_regions=2 * len(layers),
            num_slots=num_slots,
            slot_capacity=capacity,
            max_model_len=max_len,
            deferred_reclaim=cache.vattention_deferred_reclaim,
        )
        needed = _check_capacity(manager, budget)
        return KVBuild(
            manager=manager,
            config=config,
            make_worker=lambda layers: VAttentionKVCache(layers, num_slots, capacity, storage, hugepages),
            block_size=1,
            num_blocks=0,
            summary=(
                f"KV cache (vattention): {num_slots} slots x {capacity} tokens reserved "
                f"({2 * len(layers) * num_slots * capacity * token_bytes / 2**30:.1f} GiB of address space "
                f"over {len(layers)} layers, KV {storage}); budget {num_pages} pages of "
                f"{page_bytes // 1024} KiB{' (transparent huge pages)' if hugepages else ''}, max "
                f"concurrency {num_pages / needed:.1f}x at max_model_len={max_len}."
            ),
        )

    def view(self, manager: KVManager, running: Sequence[Request]) -> SlotKVView:
        assert isinstance(manager, VAttentionKVManager), type(manager)
        return take_slot_view(manager, running)


BACKEND = VAttentionBackend()
