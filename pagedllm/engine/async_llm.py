"""AsyncLLM: the server's engine. Tokenizes, validates and detokenizes in the front end;
the scheduler and model run in the engine-core process (see core_proc.py).

Tokenization runs on the tokenizer thread, off the event loop (``encode``, ``run_tokenizer``;
``generate`` tokenizes there too); ``add_request`` tokenizes in place only when given no
``prompt_token_ids``, so the server always passes them. ``add_request`` validates
synchronously (a ValueError means a bad request) and returns a stream; ``generate`` wraps both and aborts the request if the consumer stops early (a client
that disconnected), so its KV blocks are freed.

Admission control: with ``max_waiting_requests`` set, at most ``max_num_seqs +
max_waiting_requests`` sequences are in flight; beyond that ``add_request`` raises
``EngineOverloadedError`` (the server's 503 with Retry-After). With ``request_timeout_s`` set,
a request still unfinished that long after its arrival is aborted (its blocks freed) and its
stream ends with ``RequestTimeoutError``. A request whose processing raises ends with
``RequestFaultError``; the others go on.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.config import EngineConfig, ModelConfig, resolve_kv_cache_dtype
from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.engine.core_client import CoreClient, EngineDeadError, StartedCore, UtilityError
from pagedllm.engine.core_messages import CoreOutputs
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.kv_snapshot import KVSnapshot
from pagedllm.engine.llm_engine import check_generation, check_priority, make_pooling_request, make_requests
from pagedllm.lora.request import LoRARequest
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.request_stats import RequestStatsTracker
from pagedllm.kv_backends import get_kv_backend
from pagedllm.metrics import EngineMetrics
from pagedllm.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")

KV_SNAPSHOT_MAX_AGE_S = 0.2
"""Dashboard viewers within this interval share one engine snapshot."""
KV_SNAPSHOT_TIMEOUT_S = 30.0


class EngineNotReadyError(RuntimeError):
    """The model is still loading, or the engine is shutting down (or dead): retry later."""

    retry_after_s: int = 1


class EngineOverloadedError(EngineNotReadyError):
    """The waiting queue is full."""


class RequestTimeoutError(EngineNotReadyError):
    """The request ran past the server's time limit and was aborted."""


class RequestFailedError(EngineNotReadyError):
    """The engine could not complete this request for lack of resources (a beam search whose
    beams were preempted); the client may retry (the server answers 503)."""


class RequestFaultError(RuntimeError):
    """Processing this request raised (a fault in the engine); other requests are unaffected."""


class RequestRejectedError(RequestFaultError):
    """The engine found the request cannot be served as asked, the request's own fault (a
    constraint no token of the vocabulary can follow): the server answers 400."""


EXPIRY_CHECK_INTERVAL_S = 0.2
DRAIN_POLL_S = 0.05
DRAIN_FREE_WAIT_S = 5.0
"""A graceful stop asks the core this long at most for every block to be let go."""
STALLED_STREAM_TIMEOUT_S = 1.0
"""A request whose output waited this long unread is paused (out of the batch) until read."""
STALLED_STREAM_ABORT_TIMEOUT_S = 60.0
"""A request paused this long is aborted and its KV blocks freed."""
STALL_CHECK_INTERVAL_S = 0.2


class KVTransferFailedError(EngineNotReadyError):
    """Disaggregated prefill with kv_load_failure_policy "fail": the prompt's KV could not be
    pulled from the prefill instance (the server answers 503, as for an unavailable engine)."""


class RequestStream:
    """The outputs of one request, as the output handler delivers them.

    At most one output waits here, however slowly the consumer reads: outputs are cumulative
    (full text, token ids and logprobs so far), so a new one replaces the one not yet taken
    (as vLLM's output collector merges them). A client that stops reading costs one output's
    memory, not one per step. An error ends the stream after the pending output.
    """

    def __init__(self, request_id: str, engine: AsyncLLM, deadline: float | None = None) -> None:
        self.request_id = request_id
        self.deadline = deadline  # time.monotonic() after which the request is aborted
        self.finished = False
        self._pending: RequestOutput | None = None
        self.pending_since: float | None = None  # time.monotonic() the unread output has waited since
        self.paused_since: float | None = None  # paused in the core (its client stopped reading)
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._engine = engine

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            if self._error is None:
                self._error = item
        elif self._pending is None or not self._pending.finished:
            if self._pending is None:
                self.pending_since = time.monotonic()
            self._pending = item  # cumulative: the newer output holds everything the older did
        self._ready.set()

    @property
    def num_pending(self) -> int:
        """Items waiting for the consumer (at most an output and an error)."""
        return (self._pending is not None) + (self._error is not None)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self.finished:
                raise StopAsyncIteration
            if self._pending is not None:
                item, self._pending = self._pending, None
                self.pending_since = None
                if self.paused_since is not None:  # the client reads again
                    self._engine._pause(self, False)
                if item.finished:
                    self.finished = True
                return item
            if self._error is not None:
                self.finished = True
                raise self._error
            self._ready.clear()
            await self._ready.wait()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncLLM:
    def __init__(
        self, args: EngineArgs, model_name: str, max_waiting_requests: int | None = None,
        request_timeout_s: float | None = None, started_core: StartedCore | None = None,
        metrics_names: str = "pagedllm",
        stalled_stream_timeout_s: float | None = STALLED_STREAM_TIMEOUT_S,
        stalled_stream_abort_timeout_s: float | None = STALLED_STREAM_ABORT_TIMEOUT_S,
    ) -> None:
        """``stalled_stream_timeout_s``: a request whose stream holds an output unread this long
        leaves the batch until its consumer reads again (None: never); one paused for
        ``stalled_stream_abort_timeout_s`` is aborted (None: never)."""
        for name, value in (("stalled_stream_timeout_s", stalled_stream_timeout_s),
                            ("stalled_stream_abort_timeout_s", stalled_stream_abort_timeout_s)):
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value} must be > 0")
        self.stalled_stream_timeout_s = stalled_stream_timeout_s
        self.stalled_stream_abort_timeout_s = stalled_stream_abort_timeout_s
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests={max_waiting_requests} must be >= 0")
        if request_timeout_s is not None and not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s={request_timeout_s} must be > 0")
        self.args = args
        self.model_name = model_name
        self.max_waiting_requests = max_waiting_requests
        self.request_timeout_s = request_timeout_s
        self.metrics = EngineMetrics(model_name, metrics_names)
        self._request_stats = RequestStatsTracker()  # phase times of user requests in flight
        self.ready = False
        self.shutting_down = False  # new requests are refused (503) and /health answers 503
        self._core_closed = False  # shutdown(): nothing more is sent to the core
        self.dead_error: BaseException | None = None
        self.unhealthy: str | None = None  # why /health answers 503 though the engine runs
        self.model_config: ModelConfig | None = None
        self.config: EngineConfig | None = None
        self.generation_defaults: dict[str, Any] = {}  # the checkpoint's sampling defaults, once ready
        self.tokenizer: Any = None
        self.input_processor: InputProcessor | None = None
        self.output_processor: OutputProcessor | None = None
        self._streams: dict[str, RequestStream] = {}
        self._beam_searches: dict[str, tuple[str | None, list[int], float]] = {}
        self._beam_widths: dict[str, int] = {}  # sequences of each beam search, for admission
        self._pooling_tasks: dict[str, str] = {}  # pooling requests in flight: their task, for the metric
        """Beam searches in flight: (prompt text, prompt token ids, arrival time)."""
        self._last_token_time: dict[str, float] = {}
        self._client: CoreClient | None = None
        self._started_core = started_core  # spawned before the front end's imports, if any
        self._task: asyncio.Task | None = None
        self._expiry_task: asyncio.Task | None = None
        self._stall_task: asyncio.Task | None = None
        self._ready_event = asyncio.Event()
        self._dead_event = asyncio.Event()  # set once the engine core died or failed to start
        self._kv_snapshot: tuple[float, KVSnapshot] | None = None  # (time taken, snapshot)
        self._kv_snapshot_fetch: asyncio.Future | None = None
        # Tokenization and chat templating: off the event loop, one at a time (a fast
        # tokenizer is not safe for concurrent calls, and it releases the GIL while encoding).
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-tokenizer")

    # ---- life cycle --------------------------------------------------------------------

    def start(self) -> None:
        """Spawn the engine core and begin handling its outputs (returns at once)."""
        _limit_front_end_threads()
        if self.args.data_parallel_size > 1:
            from pagedllm.engine.dp_client import DPCoreClient

            self._client = DPCoreClient(self.args.create_engine_config(), self.metrics.replica_metrics())
        else:
            self._client = CoreClient(self.args, self._started_core)
        self._task = asyncio.get_running_loop().create_task(self._run_output_handler())
        if self.request_timeout_s is not None:
            self._expiry_task = asyncio.get_running_loop().create_task(self._expire_requests())
        if self.stalled_stream_timeout_s is not None:
            self._stall_task = asyncio.get_running_loop().create_task(self._pause_stalled())

    async def wait_ready(self) -> None:
        await self._ready_event.wait()
        if self.dead_error is not None:
            raise self.dead_error

    async def shutdown(self) -> None:
        """Fail what is in flight, stop the core process and the output handler."""
        self.shutting_down = True
        self._core_closed = True
        self.ready = False
        for stream in list(self._streams.values()):
            stream.put(EngineNotReadyError("the server is shutting down"))
        self._streams.clear()
        for task in (self._expiry_task, self._stall_task):
            if task is not None:
                task.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self._client is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._client.shutdown)
        self._tokenizer_thread.shutdown(wait=False)

    async def drain(self, timeout_s: float, stop_now: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        """A graceful stop (SIGTERM): new requests are refused with a 503 from now on; those in
        flight get up to ``timeout_s`` seconds to finish (less if ``stop_now()`` turns true), then
        the rest are aborted (their clients get a 503) and the core is asked until it holds no
        request and no KV block. Returns the figures it logs."""
        self.shutting_down = True
        in_flight = len(self._streams)
        deadline = time.monotonic() + timeout_s
        while self._streams and self.dead_error is None and not stop_now() and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        left = list(self._streams.values())
        for stream in left:
            stream.put(EngineNotReadyError(
                f"the server stopped before the request finished (--shutdown-timeout {timeout_s:g} s)"))
            self.abort(stream.request_id)
        usage = None
        if self._client is not None and self.ready and self.dead_error is None:
            deadline = time.monotonic() + DRAIN_FREE_WAIT_S
            while True:  # the aborts reach the core as messages: ask until it has let go
                try:
                    usage = await asyncio.wait_for(self._call_utility("kv_usage"), DRAIN_FREE_WAIT_S)
                except (asyncio.TimeoutError, EngineNotReadyError, RequestFaultError):
                    break
                if usage["num_running"] + usage["num_waiting"] + usage["num_paused"] == 0 and usage["kv_blocks_used"] == 0:
                    break
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(DRAIN_POLL_S)
        figures = {"in_flight": in_flight, "finished": in_flight - len(left), "aborted": len(left),
                   "core": usage}
        logger.info("shutdown: %d request(s) in flight, %d finished within %g s, %d aborted; engine core: %s",
                    in_flight, in_flight - len(left), timeout_s, len(left),
                    "unknown" if usage is None else
                    f"{usage['num_running']} running, {usage['num_waiting']} waiting, "
                    f"{usage['kv_blocks_used']} KV block(s) in use")
        return figures

    # ---- tokenization (off the event loop) ----------------------------------------------

    async def run_tokenizer(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a blocking tokenizer or template call on the tokenizer thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread, functools.partial(fn, *args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids (a BOS as the model adds it, unless add_special_tokens is
        False), on the tokenizer thread."""
        assert self.input_processor is not None
        return await self.run_tokenizer(self.input_processor.encode, text, add_special_tokens)

    # ---- requests ----------------------------------------------------------------------

    def _check_ready(self) -> None:
        if self.dead_error is not None:
            raise EngineNotReadyError(f"the engine is dead: {self.dead_error}")
        if self.shutting_down:
            raise EngineNotReadyError("the server is shutting down")
        if not self.ready:
            raise EngineNotReadyError("the model is still loading")

    def check_admission(self, num_seqs: int) -> None:
        """Raise EngineOverloadedError if `num_seqs` more sequences would overflow the waiting
        queue; ValueError if they never could (more than the queue and the batch together)."""
        if self.max_waiting_requests is None:
            return
        assert self.config is not None and self.output_processor is not None
        capacity = self.config.scheduler_config.max_num_seqs + self.max_waiting_requests
        if num_seqs > capacity:
            raise ValueError(
                f"the request asks for {num_seqs} sequences (prompts x n), more than this server "
                f"ever queues ({capacity} = max_num_seqs + max_waiting_requests); lower n or send "
                f"fewer prompts per request"
            )
        in_flight = len(self.output_processor.states) + sum(self._beam_widths.values())
        if in_flight + num_seqs > capacity:
            raise EngineOverloadedError(
                f"the server is overloaded: {in_flight} sequences in flight, at most {capacity} "
                f"(max_num_seqs + max_waiting_requests); retry later"
            )

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        mm_features: list[MultiModalFeature] | None = None,
    ) -> RequestStream:
        """Validate and queue a request. Raises ValueError on bad input. ``mm_features``: the
        prompt's preprocessed images (InputProcessor.render_chat_inputs, on a worker thread)."""
        self._check_ready()
        assert self.input_processor is not None and self.model_config is not None
        assert self.config is not None
        check_priority(priority, self.config.scheduler_config.scheduling_policy)
        check_generation(self.model_config)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        self.check_admission(params.n)
        if prompt_token_ids is None:
            text, prompt_token_ids = self.input_processor.tokenize(prompt)
        else:
            text = prompt if isinstance(prompt, str) else None
        max_tokens = self.input_processor.validate(prompt_token_ids, params)
        if self.config is not None:
            get_kv_backend(self.config.cache_config.kv_cache_backend).check_num_sequences(params.n)
        if kv_transfer_params is not None:
            self._check_kv_transfer_params(kv_transfer_params, params)
        assert self.output_processor is not None
        request = make_requests(
            request_id, text, prompt_token_ids, params, max_tokens, self.model_config,
            self.tokenizer, self.output_processor, cache_salt, kv_transfer_params, priority, lora_request,
            mm_features,
        )
        deadline = None if self.request_timeout_s is None else time.monotonic() + self.request_timeout_s
        stream = RequestStream(request_id, self, deadline)
        self._streams[request_id] = stream
        self._request_stats.add(request_id, params.max_tokens)
        assert self._client is not None
        self._send(request_id, lambda client: client.add_request(request))
        return stream

    def add_pooling_request(
        self, request_id: str, text: str | None, prompt_token_ids: list[int], params: PoolingParams,
        priority: int = 0,
    ) -> RequestStream:
        """Validate and queue a pooling request (its stream yields one PoolingRequestOutput).
        Raises ValueError on bad input (a prompt past the model's length, a task the model lacks)."""
        self._check_ready()
        assert self.model_config is not None and self.output_processor is not None and self.config is not None
        check_priority(priority, self.config.scheduler_config.scheduling_policy)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        self.check_admission(1)
        request = make_pooling_request(
            request_id, text, prompt_token_ids, params, self.model_config, self.output_processor, priority)
        deadline = None if self.request_timeout_s is None else time.monotonic() + self.request_timeout_s
        stream = RequestStream(request_id, self, deadline)
        self._streams[request_id] = stream
        self._pooling_tasks[request_id] = params.task
        self._send(request_id, lambda client: client.add_request(request))
        return stream

    async def pool(
        self, request_id: str, text: str | None, prompt_token_ids: list[int], params: PoolingParams,
        priority: int = 0,
    ) -> PoolingRequestOutput:
        """One pooling request's output; the request is aborted if the caller stops waiting."""
        stream = self.add_pooling_request(request_id, text, prompt_token_ids, params, priority)
        try:
            async for output in stream:
                if output.finished:
                    return output  # type: ignore[return-value]
            raise RuntimeError(f"pooling request {request_id!r} ended without an output")
        finally:
            stream.abort()

    def add_beam_search(
        self,
        request_id: str,
        prompt: PromptType,
        params: BeamSearchParams,
        prompt_token_ids: list[int] | None = None,
    ) -> RequestStream:
        """Queue a beam search (run in the core over shared KV blocks). Its stream yields one
        finished RequestOutput with the beams, best first, as its outputs."""
        self._check_ready()
        assert self.input_processor is not None and self.model_config is not None
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        self.check_admission(params.beam_width)
        if prompt_token_ids is None:
            text, prompt_token_ids = self.input_processor.tokenize(prompt)
        else:
            text = prompt if isinstance(prompt, str) else None
        self.input_processor.validate(
            prompt_token_ids, SamplingParams(max_tokens=params.max_tokens, temperature=0.0)
        )
        deadline = None if self.request_timeout_s is None else time.monotonic() + self.request_timeout_s
        stream = RequestStream(request_id, self, deadline)
        self._streams[request_id] = stream
        self._beam_searches[request_id] = (text, list(prompt_token_ids), time.monotonic())
        self._beam_widths[request_id] = params.beam_width
        self._send(request_id, lambda client: client.add_beam_search(request_id, list(prompt_token_ids), params))
        return stream

    def _send(self, request_id: str, send: Callable[[CoreClient], None]) -> None:
        """Hand a queued request to the core; if the core is gone, undo it (a 503)."""
        assert self._client is not None
        try:
            send(self._client)
        except EngineDeadError as e:
            self.abort(request_id)
            raise EngineNotReadyError(f"the engine is dead: {e}") from None

    def _beam_search_output(self, eo: EngineCoreOutput, now: float) -> RequestOutput | BaseException:
        text, prompt_token_ids, arrival = self._beam_searches.pop(eo.request_id)
        self._beam_widths.pop(eo.request_id, None)
        if eo.error is not None or eo.beams is None:
            self.metrics.observe_finished("abort", now - arrival)
            if eo.error is not None and not eo.retryable:  # a fault in its processing: a 500
                logger.error("beam search %s failed: %s", eo.request_id, eo.error)
                return RequestFaultError(f"the engine failed while processing this request: {eo.error}")
            return RequestFailedError(eo.error or "beam search failed")
        outputs = [
            CompletionOutput(
                index=i, text=self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True),
                token_ids=list(seq.output_token_ids), finish_reason=seq.finish_reason,
                cumulative_logprob=seq.cum_logprob,
            )
            for i, seq in enumerate(eo.beams)
        ]
        self.metrics.observe_finished("stop", now - arrival)
        return RequestOutput(
            eo.request_id, text, prompt_token_ids, outputs, finished=True,
            metrics={"arrival_time": arrival, "finished_time": now},
        )

    def _check_kv_transfer_params(self, kv_transfer_params: dict, params: SamplingParams) -> None:
        from pagedllm.distributed.kv_transfer.zmq_connector import validate_kv_transfer_params

        if self.args.kv_transfer_config is None:
            raise ValueError(
                "kv_transfer_params given, but this server runs without --kv-transfer-config "
                "(start it with a kv_role to take part in disaggregated prefill)"
            )
        if params.n != 1:
            raise ValueError("kv_transfer_params needs n=1")
        validate_kv_transfer_params(kv_transfer_params, self._kv_transfer_config())

    def _kv_transfer_config(self):
        from pagedllm.distributed.kv_transfer.config import KVTransferConfig

        config = self.config.kv_transfer_config if self.config is not None else None
        return config if config is not None else KVTransferConfig.from_cli(self.args.kv_transfer_config)

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        prompt_token_ids: list[int] | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative RequestOutputs; the request is aborted if iteration stops early."""
        if prompt_token_ids is None:
            self._check_ready()
            assert self.input_processor is not None
            prompt, prompt_token_ids = await self.run_tokenizer(self.input_processor.tokenize, prompt)
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
        self._beam_widths.pop(request_id, None)
        self._pooling_tasks.pop(request_id, None)
        self._request_stats.drop(request_id)
        if self._beam_searches.pop(request_id, None) is not None:
            self.metrics.observe_aborted()
            if self._client is not None and not self._core_closed:
                self._client.abort_requests([request_id])
            return
        if self.output_processor is None:
            return
        core_ids = self.output_processor.core_request_ids([request_id])  # n > 1: every sequence
        for core_id in core_ids:
            self._last_token_time.pop(core_id, None)
        if self.output_processor.abort_requests([request_id]):
            self.metrics.observe_aborted()
            if self._client is not None and not self._core_closed:
                self._client.abort_requests(core_ids)

    async def reset_prefix_cache(self) -> bool:
        self._check_ready()
        return await self._call_utility("reset_prefix_cache")

    async def save_kv(self, name: str, token_ids: list[int], cache_salt: str | None = None) -> dict[str, Any]:
        """/v1/kv/save in the core: {"num_tokens"} saved, or {"error"} naming why not."""
        self._check_ready()
        return await self._call_utility("kv_save", (name, token_ids, cache_salt))

    async def restore_kv(self, name: str) -> dict[str, Any]:
        """/v1/kv/restore in the core: {"num_tokens"} restored, or {"error"} naming why not."""
        self._check_ready()
        return await self._call_utility("kv_restore", name)

    async def add_lora(self, request: Any) -> None:
        """Load and check a LoRA adapter in the engine core (its shapes against the model);
        ValueError (a 400) naming why it is refused."""
        self._check_ready()
        refused = await self._call_utility("add_lora", request)
        if refused is not None:
            raise ValueError(refused)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unload a LoRA adapter in the engine core (its slot freed once unused)."""
        self._check_ready()
        return await self._call_utility("remove_lora", lora_int_id)

    async def _call_utility(self, name: str, payload: Any = None) -> Any:
        """A utility in the core; one that raised there is a RequestFaultError (a 500), a dead
        core an EngineNotReadyError (a 503)."""
        assert self._client is not None
        try:
            return await self._client.call_utility(name, payload)
        except UtilityError as e:
            raise RequestFaultError(str(e)) from None
        except EngineDeadError as e:
            raise EngineNotReadyError(f"the engine is dead: {e}") from None

    async def get_kv_snapshot(self) -> tuple[KVSnapshot, float]:
        """The engine's KV snapshot and its age in seconds. Fetched at most every
        ``KV_SNAPSHOT_MAX_AGE_S``; concurrent callers share one fetch."""
        self._check_ready()
        if self._kv_snapshot is not None:
            taken, snapshot = self._kv_snapshot
            if time.monotonic() - taken < KV_SNAPSHOT_MAX_AGE_S:
                return snapshot, time.monotonic() - taken
        if self._kv_snapshot_fetch is None:
            self._kv_snapshot_fetch = asyncio.ensure_future(self._fetch_kv_snapshot())
        snapshot = await asyncio.shield(self._kv_snapshot_fetch)  # a leaving viewer cancels only itself
        return snapshot, 0.0

    async def _fetch_kv_snapshot(self) -> KVSnapshot:
        assert self._client is not None
        try:
            snapshot = await asyncio.wait_for(self._call_utility("kv_snapshot"), KV_SNAPSHOT_TIMEOUT_S)
        except asyncio.TimeoutError as e:
            raise EngineNotReadyError("the engine did not answer the KV snapshot request") from e
        finally:
            self._kv_snapshot_fetch = None
        self._kv_snapshot = (time.monotonic(), snapshot)
        return snapshot

    def replica_states(self) -> list[dict[str, Any]]:
        """Per data-parallel replica: up, requests in flight, running, waiting, KV usage,
        requests routed (empty with one engine core)."""
        return [] if self._client is None else self._client.replica_states()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    # ---- outputs -----------------------------------------------------------------------

    async def _run_output_handler(self) -> None:
        assert self._client is not None
        try:
            info = await self._client.wait_ready()
            self.model_config, self.config, self.tokenizer = info.model_config, info.config, info.tokenizer
            self.generation_defaults = info.generation_defaults
            self.input_processor = InputProcessor(
                self.tokenizer, self.model_config, self.config.speculative_config, self.args.max_logprobs,
                self.config.multimodal_config)
            self.output_processor = OutputProcessor(self.tokenizer)
            self.metrics.engine_ready(self.model_config.max_model_len, _cache_info(info))
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
                stream.put(EngineNotReadyError(f"the engine is dead: {self.dead_error}"))
            self._streams.clear()
            self._dead_event.set()

    async def wait_dead(self) -> BaseException:
        """Return the error once the engine core has died (or failed to start)."""
        await self._dead_event.wait()
        assert self.dead_error is not None
        return self.dead_error

    async def _expire_requests(self) -> None:
        """Abort the requests past their deadline (checked every EXPIRY_CHECK_INTERVAL_S)."""
        while True:
            await asyncio.sleep(EXPIRY_CHECK_INTERVAL_S)
            now = time.monotonic()
            for stream in list(self._streams.values()):
                if stream.deadline is not None and now > stream.deadline:
                    logger.warning("request %s exceeded the %.1f s time limit; aborting it",
                                   stream.request_id, self.request_timeout_s)
                    stream.put(RequestTimeoutError(
                        f"the request did not finish within the server's time limit of "
                        f"{self.request_timeout_s:g} s (--request-timeout) and was aborted; "
                        f"lower max_tokens or retry later"))
                    self.abort(stream.request_id)

    async def _pause_stalled(self) -> None:
        """Backpressure: pause the requests whose stream output waited unread longer than
        ``stalled_stream_timeout_s`` (the core stops scheduling them, so the batch holds only
        requests whose clients read); abort those paused for ``stalled_stream_abort_timeout_s``."""
        assert self.stalled_stream_timeout_s is not None
        while True:
            await asyncio.sleep(STALL_CHECK_INTERVAL_S)
            now = time.monotonic()
            abort_after = self.stalled_stream_abort_timeout_s
            for stream in list(self._streams.values()):
                if stream.finished:
                    continue
                if stream.paused_since is not None:
                    if abort_after is not None and now - stream.paused_since > abort_after:
                        logger.warning("request %s: its client read nothing for %.0f s; aborting it",
                                       stream.request_id, now - stream.paused_since)
                        stream.put(RequestTimeoutError(
                            f"the stream was not read for {abort_after:g} s "
                            f"(--stalled-stream-abort-timeout); the request was aborted"))
                        self.abort(stream.request_id)
                elif (stream.pending_since is not None
                      and now - stream.pending_since > self.stalled_stream_timeout_s):
                    self._pause(stream, True)

    def _pause(self, stream: RequestStream, pause: bool) -> None:
        """Pause (or resume) a stream's sequences in the core."""
        if self.output_processor is None or self._client is None or self._core_closed:
            return
        if stream.request_id in self._beam_searches or stream.request_id in self._pooling_tasks:
            return  # one output, at the end: nothing to pause
        core_ids = self.output_processor.core_request_ids([stream.request_id])
        if pause:
            stream.paused_since = time.monotonic()
        else:
            stream.paused_since = None
        logger.debug("request %s %s", stream.request_id, "paused: its client stopped reading" if pause else "resumed")
        self._client.pause_requests(core_ids, pause)

    def _fail(self, request_id: str, error: BaseException) -> None:
        """End one user request with an error and abort it; the others go on."""
        logger.error("request %s failed: %s: %s", request_id, type(error).__name__, error)
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(RequestFaultError(
                f"the engine failed while processing this request: {type(error).__name__}: {error}"))
        self.abort(request_id)

    def _process(self, core_outputs: CoreOutputs) -> None:
        """One batch of the core's outputs: failures, then per-request timing, then the
        output processor's results to the streams, then the engine-wide stats."""
        assert self.output_processor is not None and self._client is not None
        now = time.monotonic()
        core_outputs.outputs = self._take_failed(core_outputs.outputs)
        self._observe_outputs(core_outputs.outputs, now)
        processed = self.output_processor.process_outputs(core_outputs.outputs)
        states = self.output_processor.states
        for eo in core_outputs.outputs:  # finished sequences (n > 1 included) leave the ITL map
            if eo.request_id not in states:
                self._last_token_time.pop(eo.request_id, None)
        if processed.reqs_to_abort:  # stop strings matched here: the core stops them too
            self._client.abort_requests(processed.reqs_to_abort, stopped=True)
        for request_id, error in processed.failed.items():
            self._fail(request_id, error)
        self._deliver(processed.request_outputs, now)
        if core_outputs.stats is not None:
            self.metrics.record_stats(core_outputs.stats)
            kv_transfer = core_outputs.stats.kv_transfer or {}
            if kv_transfer.get("dead_threads") and self.unhealthy is None:
                self.unhealthy = f"{kv_transfer['dead_threads']:.0f} KV transfer thread(s) died"
                logger.error("%s: /health answers 503", self.unhealthy)
        if not self.args.disable_log_stats:
            self.metrics.maybe_log(now)

    def _take_failed(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Fail the requests the core failed and return the other outputs (beam searches
        carry their own errors, handled with their results)."""
        assert self.output_processor is not None
        states = self.output_processor.states
        failed = [eo for eo in outputs if eo.error is not None and eo.request_id in states]
        if not failed:
            return outputs
        for eo in failed:
            user_id = self.output_processor.user_request_id(eo.request_id)
            if eo.retryable or eo.invalid:
                # A KV pull that failed under policy "fail": a 503; the request's own fault: a 400.
                stream = self._streams.get(user_id)
                if stream is not None:
                    stream.put(KVTransferFailedError(eo.error) if eo.retryable else RequestRejectedError(eo.error))
                self.abort(user_id)
            else:  # a step that raised: a 500
                self._fail(user_id, RuntimeError(eo.error))
        failed_ids = {eo.request_id for eo in failed}
        return [eo for eo in outputs if eo.request_id not in failed_ids]

    def _observe_outputs(self, outputs: list[EngineCoreOutput], now: float) -> None:
        """Finished beam searches to their streams; per request, its scheduling time and its
        tokens' timing (TTFT, inter-token latency) into the metrics and request stats."""
        assert self.output_processor is not None
        states = self.output_processor.states
        for eo in outputs:
            if eo.request_id in self._beam_searches and eo.finished:
                stream = self._streams.pop(eo.request_id, None)
                result = self._beam_search_output(eo, now)
                if stream is not None:
                    stream.put(result)
            state = states.get(eo.request_id)
            if state is None:
                continue
            user_id = self.output_processor.user_request_id(eo.request_id)
            if eo.scheduled_time is not None:
                self._request_stats.scheduled(user_id, eo.scheduled_time)
            if not eo.new_token_ids:
                continue
            last = self._last_token_time.get(eo.request_id)
            if last is None:
                self.metrics.observe_first_token(now - state.arrival_time, len(state.prompt_token_ids))
            self.metrics.observe_tokens(len(eo.new_token_ids), None if last is None else now - last)
            self._last_token_time[eo.request_id] = now
            self._request_stats.tokens(user_id, now)

    def _deliver(self, request_outputs: list[RequestOutput], now: float) -> None:
        """Each RequestOutput to its stream; a finished one closes its records."""
        for out in request_outputs:
            stream = self._streams.get(out.request_id)
            if isinstance(out, PoolingRequestOutput):
                self._streams.pop(out.request_id, None)
                self.metrics.observe_pooling(self._pooling_tasks.pop(out.request_id, "embed"),
                                             now - out.metrics["arrival_time"])
            elif out.finished:
                self._streams.pop(out.request_id, None)
                self._last_token_time.pop(out.request_id, None)
                reason = out.outputs[0].finish_reason or "abort"
                stats = self._request_stats.finish(out, reason, now)
                self.metrics.observe_finished(reason, stats.e2e_latency, stats)
            if stream is not None:
                stream.put(out)


def _cache_info(info: Any) -> dict[str, Any]:
    """The KV cache config as vLLM's ``cache_config_info`` labels (``num_gpu_blocks``: the
    pool's usable blocks, whatever the device; ``cache_dtype``: the KV storage), with this
    engine's own fields after them."""
    cache = info.config.cache_config
    return {
        # What the pool stores: the model's dtype under "auto", else the 8-bit format's name.
        "block_size": cache.block_size,
        "cache_dtype": resolve_kv_cache_dtype(cache.kv_cache_dtype, info.model_config.dtype),
        "enable_prefix_caching": cache.enable_prefix_caching, "num_gpu_blocks": info.num_total_blocks,
        "num_cpu_blocks": None, "kv_cache_memory_bytes": cache.kv_cache_memory_bytes,
        "kv_cache_backend": cache.kv_cache_backend,
    }


def _limit_front_end_threads() -> None:
    """The core process gets the cores for torch; the front end needs none."""
    import sys

    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
