"""LLMEngine: input processing -> EngineCore -> output processing, stepped by the caller."""

from __future__ import annotations

import itertools
import logging

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_builder import build_engine_core, check_kv_capacity  # noqa: F401
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.output_processor import OutputProcessor, RequestState
from pagedllm.outputs import RequestOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        built = build_engine_core(args)
        self.config = built.config
        self.scheduler = built.scheduler
        self.engine_core = built.engine_core
        self.tokenizer = built.tokenizer
        self.model_config = built.model_config
        self.model_dir = built.model_dir  # HF-format directory of the weights (GGUF: converted cache)
        self.input_processor = InputProcessor(self.tokenizer, self.model_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    # ---- requests ------------------------------------------------------------------------

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Raises ValueError on bad input."""
        if prompt_token_ids is None:
            text, prompt_token_ids = self.input_processor.tokenize(prompt)
        else:
            text = prompt if isinstance(prompt, str) else None
        max_tokens = self.input_processor.validate(prompt_token_ids, params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        request = Request(
            request_id,
            prompt_token_ids,
            params,
            eos_token_ids=self.model_config.eos_token_ids,
            max_tokens=max_tokens,
        )
        self.output_processor.add_request(
            RequestState(request_id, text, prompt_token_ids, params, self.tokenizer, request.arrival_time)
        )
        self.engine_core.add_request(request)
        return request_id

    def abort_request(self, request_ids: list[str]) -> None:
        self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        engine_outputs = self.engine_core.step()
        processed = self.output_processor.process_outputs(engine_outputs)
        if processed.reqs_to_abort:
            # Stop strings matched in the front end: the core stops and frees them too.
            self.scheduler.finish_requests(processed.reqs_to_abort, RequestStatus.FINISHED_STOPPED)
        return processed.request_outputs

