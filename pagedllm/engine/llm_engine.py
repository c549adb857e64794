"""LLMEngine: input processing -> EngineCore -> output processing, stepped by the caller."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any

from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.output_processor import OutputProcessor, ParentRequest, RequestState
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        # Here, not at the top: the server's front end imports this module's request helpers
        # and never builds an engine (torch stays out of its imports).
        from pagedllm.engine.core_builder import build_engine_core

        dp = config.parallel_config.data_parallel_size
        if dp > 1:
            raise ValueError(f"data_parallel_size={dp}: data parallelism runs behind `pagedllm serve` (one "
                             f"front end over {dp} engine cores); the LLM class runs one engine")
        built = build_engine_core(config)
        self.config = built.config
        self.scheduler = built.scheduler
        self.engine_core = built.engine_core
        self.tokenizer = built.tokenizer
        self.model_config = built.model_config
        self.model_dir = built.model_dir  # HF-format directory of the weights (GGUF: converted cache)
        self.input_processor = InputProcessor(
            self.tokenizer, self.model_config, self.config.speculative_config,
            self.config.sampling_config.max_logprobs, self.config.multimodal_config)
        self.generation_defaults = built.generation_defaults  # generation_config.py
        self.output_processor = OutputProcessor(self.tokenizer)
        # The engine's reasoning parser (--reasoning-parser), or None: LLM.chat reads it.
        self.reasoning_parser = self.engine_core.structured_output.reasoning if self.engine_core.structured_output else None
        self._ids = itertools.count()

    # ---- requests ------------------------------------------------------------------------

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        mm_features: list[MultiModalFeature] | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Raises ValueError on bad input.
        ``mm_features``: the images of a prompt given as token ids (InputProcessor's
        render_chat_inputs); a prompt dict's "multi_modal_data" is preprocessed here."""
        check_priority(priority, self.config.scheduler_config.scheduling_policy)
        if prompt_token_ids is None:
            text, prompt_token_ids, mm_features = self.input_processor.tokenize_prompt(prompt)
        else:
            text = prompt if isinstance(prompt, str) else None
        if isinstance(params, PoolingParams):
            if mm_features:
                raise ValueError("multi_modal_data is taken by generate and chat only (not by beam search or pooling)")
            request_id = request_id if request_id is not None else str(next(self._ids))
            core_request = make_pooling_request(
                request_id, text, prompt_token_ids, params, self.model_config, self.output_processor, priority)
            return self._submit(request_id, core_request)
        check_generation(self.model_config)
        max_tokens = self.input_processor.validate(prompt_token_ids, params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        core_request = make_requests(
            request_id, text, prompt_token_ids, params, max_tokens, self.model_config,
            self.tokenizer, self.output_processor, cache_salt, priority=priority, lora_request=lora_request,
            mm_features=mm_features,
        )
        return self._submit(request_id, core_request)

    def _submit(self, request_id: str, core_request: Any) -> str:
        """Hand the request's core request(s) to the core; a refusal there (ValueError) drops
        the front end's state for it and raises."""
        try:
            self.engine_core.add_request(core_request)
        except ValueError:
            self.output_processor.abort_requests([request_id])
            raise
        return request_id

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


def make_requests(
    request_id: str,
    text: str | None,
    prompt_token_ids: list[int],
    params: SamplingParams,
    max_tokens: int,
    model_config: ModelConfig,
    tokenizer: Any,
    output_processor: OutputProcessor,
    cache_salt: str | None = None,
    kv_transfer_params: dict | None = None,
    priority: int = 0,
    lora_request: LoRARequest | None = None,
    mm_features: list[MultiModalFeature] | None = None,
) -> Request:
    """Register a validated request with the output processor; return the core request to
    submit. For n > 1, one core request per sequence ("{i}_{request_id}", as vLLM) in one
    group: the first is submitted and forks the others once its prompt is computed. The
    sequences of a group share one arrival time and priority (the scheduler keeps them
    together in its queues)."""
    arrival_time = time.monotonic()

    def core_request(core_id: str, child: SamplingParams, group_id: str | None) -> Request:
        return Request(
            core_id, prompt_token_ids, child, eos_token_ids=model_config.eos_token_ids,
            max_tokens=max_tokens, arrival_time=arrival_time, group_id=group_id, cache_salt=cache_salt,
            kv_transfer_params=kv_transfer_params, priority=priority, lora_request=lora_request,
            mm_features=mm_features,
        )

    if params.n == 1:
        request = core_request(request_id, params, None)
        output_processor.add_request(
            RequestState(request_id, text, prompt_token_ids, params, tokenizer, request.arrival_time)
        )
        return request
    children = [core_request(f"{i}_{request_id}", child_params(params, i), request_id) for i in range(params.n)]
    leader = children[0]
    leader.pending_forks = children[1:]
    states = [
        RequestState(c.request_id, text, prompt_token_ids, c.sampling_params, tokenizer, c.arrival_time, index=i)
        for i, c in enumerate(children)
    ]
    output_processor.add_parent_request(ParentRequest(request_id, states))
    return leader


POOLING_SAMPLING = SamplingParams(max_tokens=1, detokenize=False)
"""A pooling request's sampling parameters: none apply (it finishes with its pooled vector)."""


def check_generation(model_config: ModelConfig) -> None:
    """ValueError for a generation request to a model that only pools."""
    if model_config.runner == "pooling":
        raise ValueError(
            f"model {model_config.model!r} is a pooling model ({model_config.architecture}, runner='pooling'): it "
            "embeds, classifies and scores (/v1/embeddings, /classify, /score, /rerank), it does not generate"
        )


def check_pooling(model_config: ModelConfig, params: PoolingParams, num_tokens: int) -> None:
    """ValueError for a pooling request the model cannot serve, or a prompt past its length."""
    if model_config.pooler is None:
        raise ValueError(f"model {model_config.model!r} does not pool")
    if params.task in ("classify", "score") and model_config.num_labels is None:
        raise ValueError(
            f"model {model_config.model!r} ({model_config.architecture}) has no classifier: task "
            f"{params.task!r} needs a *ForSequenceClassification checkpoint"
        )
    if params.task == "score" and model_config.num_labels != 1:
        raise ValueError(
            f"model {model_config.model!r} has {model_config.num_labels} labels: task 'score' needs a "
            "single-label cross-encoder"
        )
    limit = model_config.max_model_len - 1
    if num_tokens > limit:
        raise ValueError(
            f"the input has {num_tokens} tokens, more than this model's maximum of {limit}; shorten it or set "
            "truncate_prompt_tokens"
        )
    if num_tokens == 0:
        raise ValueError("the input is empty: give at least one token")


def make_pooling_request(
    request_id: str, text: str | None, prompt_token_ids: list[int], params: PoolingParams,
    model_config: ModelConfig, output_processor: OutputProcessor, priority: int = 0,
) -> Request:
    """Check a pooling request and register it with the output processor; return the core
    request to submit (it reads every prompt state unless the model pools the last token)."""
    check_pooling(model_config, params, len(prompt_token_ids))
    vocab = model_config.vocab_size
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is out of the vocabulary [0, {vocab})")
    assert model_config.pooler is not None
    request = Request(
        request_id, prompt_token_ids, POOLING_SAMPLING, max_tokens=1, priority=priority, pooling_params=params,
        reads_whole_prompt=model_config.pooler.pooling_type != "LAST",
    )
    output_processor.add_request(RequestState(
        request_id, text, prompt_token_ids, POOLING_SAMPLING, None, request.arrival_time, pooling=True))
    return request


def check_priority(priority: int, scheduling_policy: str) -> None:
    """A request priority other than 0 needs --scheduling-policy priority (as vLLM)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if priority != 0 and scheduling_policy != "priority":
        raise ValueError(
            f"priority={priority} needs --scheduling-policy priority; this engine schedules "
            f"{scheduling_policy}"
        )


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

