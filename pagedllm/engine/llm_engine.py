"""LLMEngine: input processing -> EngineCore -> output processing, stepped by the caller."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

from pagedllm.core.kv_cache_manager import KVCacheGroupSpec, KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.output_processor import OutputProcessor, ParentRequest, RequestState
from pagedllm.outputs import RequestOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
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
        # Equal-sized KV cache groups per attention type (full, sliding window); a block
        # spans one layer slice per layer of a group (worker/kv_cache.py).
        layers = attention_layers(loaded.model)
        group_specs = [KVCacheGroupSpec(g.sliding_window) for g in kv_cache_groups(layers)]
        layer_slots = num_layer_slots(layers)
        num_blocks = num_blocks_for_budget(
            model_config, block_size, budget_config.kv_cache_memory_bytes, layer_slots
        )
        self.config = args.create_engine_config(model_config, num_blocks)
        kv_manager = KVCacheManager(
            num_blocks=num_blocks,
            block_size=block_size,
            max_model_len=model_config.max_model_len,
            enable_caching=args.enable_prefix_caching,
            hash_extra_keys=(model_config.model, model_config.dtype, block_size),
            group_specs=group_specs,
        )
        check_kv_capacity(
            num_blocks,
            kv_manager.max_blocks_per_request(
                model_config.max_model_len, self.config.scheduler_config.max_num_batched_tokens
            ),
            block_size,
            model_config.max_model_len,
            budget_config.kv_cache_memory_bytes,
        )
        self.scheduler = Scheduler(self.config.scheduler_config, kv_manager)
        runner = ModelRunner(loaded.model, model_config, block_size, num_blocks, seed=args.seed)
        self.engine_core = EngineCore(self.scheduler, runner)
        self.tokenizer = loaded.tokenizer
        self.model_config = model_config
        self.model_dir = loaded.model_dir  # HF-format directory of the weights (GGUF: converted cache)
        self.input_processor = InputProcessor(self.tokenizer, model_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        pool_tokens = (num_blocks - 1) * block_size
        # Requests of max_model_len tokens (decoding) that fit at once, over all KV groups.
        max_concurrency = (num_blocks - 1) / kv_manager.max_blocks_per_request(model_config.max_model_len)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB per block over %d layers, %s), "
            "group windows %s; %d token slots, max concurrency %.1fx at "
            "max_model_len=%d. Ready in %.1f s.",
            num_blocks - 1, block_size, kv_bytes_per_block(model_config, block_size, layer_slots) / 2**20,
            layer_slots, model_config.dtype,
            [g.sliding_window for g in kv_cache_groups(layers)], pool_tokens,
            max_concurrency, model_config.max_model_len,
            time.monotonic() - t0,
        )

    # ---- requests ------------------------------------------------------------------------

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Raises ValueError on bad input."""
        if prompt_token_ids is None:
            text, prompt_token_ids = self.input_processor.tokenize(prompt)
        else:
            text = prompt if isinstance(prompt, str) else None
        max_tokens = self.input_processor.validate(prompt_token_ids, params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if params.n == 1:
            request = self._make_request(request_id, prompt_token_ids, params, max_tokens, cache_salt=cache_salt)
            self.output_processor.add_request(
                RequestState(request_id, text, prompt_token_ids, params, self.tokenizer, request.arrival_time)
            )
            self.engine_core.add_request(request)
            return request_id
        # n > 1: one core request per sequence, "{i}_{request_id}" as vLLM, in one group.
        children = [
            self._make_request(
                f"{i}_{request_id}", prompt_token_ids, child_params(params, i), max_tokens, request_id, cache_salt
            )
            for i in range(params.n)
        ]
        leader = children[0]
        leader.pending_forks = children[1:]
        states = [
            RequestState(c.request_id, text, prompt_token_ids, c.sampling_params, self.tokenizer, c.arrival_time, index=i)
            for i, c in enumerate(children)
        ]
        self.output_processor.add_parent_request(ParentRequest(request_id, states))
        try:
            self.engine_core.add_request(leader)
        except ValueError:
            self.output_processor.abort_requests([request_id])
            raise
        return request_id

    def _make_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        max_tokens: int, group_id: str | None = None, cache_salt: str | None = None,
    ) -> Request:
        return Request(
            request_id,
            prompt_token_ids,
            params,
            eos_token_ids=self.model_config.eos_token_ids,
            max_tokens=max_tokens,
            group_id=group_id,
            cache_salt=cache_salt,
        )

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort user requests (for n > 1, every sequence of each)."""
        core_ids = self.output_processor.core_request_ids(request_ids)
        self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(core_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing reset) while requests hold blocks."""
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def step(self) -> list[RequestOutput]:
        engine_outputs = self.engine_core.step()
        processed = self.output_processor.process_outputs(engine_outputs)
        if processed.reqs_to_abort:
            # Stop strings matched in the front end: the core stops and frees them too.
            self.scheduler.finish_requests(processed.reqs_to_abort, RequestStatus.FINISHED_STOPPED)
        return processed.request_outputs


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The i-th sequence's own parameters: n=1, seed + i; only the first reports prompt
    logprobs (the prompt is computed once, by it)."""
    child = dataclasses.replace(
        params,
        n=1,
        seed=params.seed + index if params.seed is not None else None,
        prompt_logprobs=params.prompt_logprobs if index == 0 else None,
    )
    child.bad_words_token_ids = params.bad_words_token_ids
    return child


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
