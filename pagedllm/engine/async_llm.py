"""AsyncLLM: the server's engine. Tokenizes, validates and detokenizes in the front end;
the scheduler and model run in the engine-core process (see core_proc.py).

``add_request`` validates synchronously (a ValueError means a bad request) and returns a
stream; ``generate`` wraps both and aborts the request if the consumer stops early (a client
that disconnected), so its KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_client import CoreClient, EngineDeadError
from pagedllm.engine.core_proc import CoreOutputs
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.llm_engine import make_requests
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.metrics import EngineMetrics
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineNotReadyError(RuntimeError):
    """The model is still loading, or the engine is shutting down."""


class KVTransferFailedError(EngineNotReadyError):
    """Disaggregated prefill with kv_load_failure_policy "fail": the prompt's KV could not be
    pulled from the prefill instance (the server answers 503, as for an unavailable engine)."""


class RequestStream:
    """The outputs of one request, as the output handler delivers them."""

    def __init__(self, request_id: str, engine: AsyncLLM) -> None:
        self.request_id = request_id
        self.finished = False
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._engine = engine

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncLLM:
    def __init__(self, args: EngineArgs, model_name: str) -> None:
        self.args = args
        self.model_name = model_name
        self.metrics = EngineMetrics(model_name)
        self.ready = False
        self.shutting_down = False
        self.dead_error: BaseException | None = None
        self.model_config: ModelConfig | None = None
        self.config: EngineConfig | None = None
        self.tokenizer: Any = None
        self.input_processor: InputProcessor | None = None
        self.output_processor: OutputProcessor | None = None
        self._streams: dict[str, RequestStream] = {}
        self._last_token_time: dict[str, float] = {}
        self._client: CoreClient | None = None
        self._task: asyncio.Task | None = None
        self._ready_event = asyncio.Event()

    # ---- life cycle --------------------------------------------------------------------

    def start(self) -> None:
        """Spawn the engine core and begin handling its outputs (returns at once)."""
        _limit_front_end_threads()
        self._client = CoreClient(self.args)
        self._task = asyncio.get_running_loop().create_task(self._run_output_handler())

    async def wait_ready(self) -> None:
        await self._ready_event.wait()
        if self.dead_error is not None:
            raise self.dead_error

    async def shutdown(self) -> None:
        """Fail what is in flight, stop the core process and the output handler."""
        self.shutting_down = True
        self.ready = False
        for stream in list(self._streams.values()):
            stream.put(EngineNotReadyError("the server is shutting down"))
        self._streams.clear()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self._client is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._client.shutdown)

    # ---- requests ----------------------------------------------------------------------

    def _check_ready(self) -> None:
        if self.dead_error is not None:
            raise EngineNotReadyError(f"the engine is dead: {self.dead_error}")
        if self.shutting_down:
            raise EngineNotReadyError("the server is shutting down")
        if not self.ready:
            raise EngineNotReadyError("the model is still loading")

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
    ) -> RequestStream:
        """Validate and queue a request. Raises ValueError on bad input."""
        self._check_ready()
        assert self.input_processor is not None and self.model_config is not None
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        if prompt_token_ids is None:
            text, prompt_token_ids = self.input_processor.tokenize(prompt)
        else:
            text = prompt if isinstance(prompt, str) else None
        max_tokens = self.input_processor.validate(prompt_token_ids, params)
        if kv_transfer_params is not None:
            self._check_kv_transfer_params(kv_transfer_params, params)
        assert self.output_processor is not None
        request = make_requests(
            request_id, text, prompt_token_ids, params, max_tokens, self.model_config,
            self.tokenizer, self.output_processor, cache_salt, kv_transfer_params,
        )
        stream = RequestStream(request_id, self)
        self._streams[request_id] = stream
        assert self._client is not None
        self._client.add_request(request)
        return stream

    def _check_kv_transfer_params(self, kv_transfer_params: dict, params: SamplingParams) -> None:
        from pagedllm.distributed.kv_transfer.zmq_connector import validate_kv_transfer_params

        if self.args.kv_transfer_config is None:
            raise ValueError(
                "kv_transfer_params given, but this server runs without --kv-transfer-config "
                "(start it with a kv_role to take part in disaggregated prefill)"
            )
        if params.n != 1:
            raise ValueError("kv_transfer_params needs n=1")
        validate_kv_transfer_params(kv_transfer_params)

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        prompt_token_ids: list[int] | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative RequestOutputs; the request is aborted if iteration stops early."""
        stream = self.add_request(request_id, prompt, params, prompt_token_ids, cache_salt)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request (unknown or finished ids are ignored)."""
        self._streams.pop(request_id, None)
        self._last_token_time.pop(request_id, None)
        if self.output_processor is None:
            return
        core_ids = self.output_processor.core_request_ids([request_id])  # n > 1: every sequence
        for core_id in core_ids:
            self._last_token_time.pop(core_id, None)
        if self.output_processor.abort_requests([request_id]):
            self.metrics.request_success.labels(model_name=self.model_name, finished_reason="abort").inc()
            if self._client is not None and not self.shutting_down:
                self._client.abort_requests(core_ids)

    async def reset_prefix_cache(self) -> bool:
        self._check_ready()
        assert self._client is not None
        return await self._client.call_utility("reset_prefix_cache")

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    # ---- outputs -----------------------------------------------------------------------

    async def _run_output_handler(self) -> None:
        assert self._client is not None
        try:
            info = await self._client.wait_ready()
            self.model_config, self.config, self.tokenizer = info.model_config, info.config, info.tokenizer
            self.input_processor = InputProcessor(self.tokenizer, self.model_config)
            self.output_processor = OutputProcessor(self.tokenizer)
            self.ready = True
            self._ready_event.set()
            logger.info("engine ready: %s, max_model_len=%d", self.model_name, self.model_config.max_model_len)
            while True:
                self._process(await self._client.get_outputs())
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the core died or failed to start
            logger.error("engine core failed: %s", e)
            self.dead_error = e if isinstance(e, EngineDeadError) else EngineDeadError(str(e))
            self.ready = False
            self._ready_event.set()
            for stream in list(self._streams.values()):
                stream.put(self.dead_error)
            self._streams.clear()

    def _process(self, core_outputs: CoreOutputs) -> None:
        assert self.output_processor is not None and self._client is not None
        now = time.monotonic()
        states = self.output_processor.states
        failed = [eo for eo in core_outputs.outputs if eo.error is not None]
        if failed:  # the core failed these requests: their clients get the error
            for eo in failed:
                stream = self._streams.pop(eo.request_id, None)
                self._last_token_time.pop(eo.request_id, None)
                self.output_processor.abort_requests([eo.request_id])
                self.metrics.request_success.labels(model_name=self.model_name, finished_reason="abort").inc()
                if stream is not None:
                    stream.put(KVTransferFailedError(eo.error))
            core_outputs.outputs = [eo for eo in core_outputs.outputs if eo.error is None]
        for eo in core_outputs.outputs:
            state = states.get(eo.request_id)
            if state is None or not eo.new_token_ids:
                continue
            last = self._last_token_time.get(eo.request_id)
            if last is None:
                self.metrics.observe_first_token(now - state.arrival_time, len(state.prompt_token_ids))
            self.metrics.observe_tokens(len(eo.new_token_ids), None if last is None else now - last)
            self._last_token_time[eo.request_id] = now
        processed = self.output_processor.process_outputs(core_outputs.outputs)
        for eo in core_outputs.outputs:  # finished sequences (n > 1 included) leave the ITL map
            if eo.request_id not in states:
                self._last_token_time.pop(eo.request_id, None)
        if processed.reqs_to_abort:  # stop strings matched here: the core stops them too
            self._client.abort_requests(processed.reqs_to_abort, stopped=True)
        for out in processed.request_outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                self._last_token_time.pop(out.request_id, None)
                reason = out.outputs[0].finish_reason or "abort"
                self.metrics.observe_finished(reason, now - out.metrics["arrival_time"])
            if stream is not None:
                stream.put(out)
        if core_outputs.stats is not None:
            self.metrics.record_stats(core_outputs.stats)
        self.metrics.maybe_log(now)


def _limit_front_end_threads() -> None:
    """The core process gets the cores for torch; the front end needs none."""
    import sys

    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
