"""What completions and chat share: errors, SamplingParams from a request body, the
context-length check, logprobs in OpenAI's shapes, and merging the streams of many prompts."""

from __future__ import annotations

import asyncio
import json
import math
import re
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel

from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.engine.async_llm import (
    AsyncLLM,
    EngineNotReadyError,
    RequestFaultError,
    RequestRejectedError,
    RequestStream,
)
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.entrypoints.openai.request_logger import RequestLogger
from pagedllm.entrypoints.openai.protocol import (
    ChatTokenLogprob,
    CompletionLogprobs,
    ErrorInfo,
    ErrorResponse,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    SamplingFields,
    TopLogprob,
    UsageInfo,
)
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams


class OpenAIError(Exception):
    """An error the client gets back in OpenAI's shape."""

    def __init__(self, message: str, status: int = 400, type: str = "BadRequestError", param: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param = message, status, type, param
        self.retry_after_s = retry_after_s  # sent as the Retry-After header

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.status))


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, "BadRequestError", param)


def engine_error(e: EngineNotReadyError | RequestFaultError) -> OpenAIError:
    """Not ready, dead, overloaded or timed out: 503 with Retry-After; a request the engine
    found it cannot serve as asked: 400; a failed request: 500."""
    if isinstance(e, EngineNotReadyError):
        return OpenAIError(str(e), 503, "ServiceUnavailableError", retry_after_s=e.retry_after_s)
    if isinstance(e, RequestRejectedError):
        return OpenAIError(str(e), 400, "BadRequestError")
    return OpenAIError(str(e), 500, "InternalServerError")


def sse(obj: BaseModel | dict) -> str:
    data = obj.model_dump_json(exclude_unset=False) if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class BeamSearchRequest:
    """use_beam_search=true: BeamSearchParams whose max_tokens, when the body leaves it out,
    is resolved per prompt (what the context has left, as for sampling)."""

    params: BeamSearchParams
    max_tokens: int | None

    def params_for(self, num_prompt_tokens: int, max_model_len: int) -> BeamSearchParams:
        if self.max_tokens is not None:
            return self.params
        return replace(self.params, max_tokens=max(1, max_model_len - num_prompt_tokens - 1))


# Sampling fields beam search does not use: a value other than the default is a 400, not dropped.
# (A seed is accepted, as with greedy sampling: the search is deterministic, nothing to seed.)
_NOT_FOR_BEAM_SEARCH = (
    "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "min_tokens", "stop_token_ids", "include_stop_str_in_output", "allowed_token_ids",
    "bad_words", "skip_special_tokens", "spaces_between_special_tokens", "cache_salt",
)


def beam_search_params_from(req: SamplingFields, max_tokens: int | None, logprobs: int | None) -> BeamSearchRequest:
    """use_beam_search=true as vLLM reads it: n is the beam width, n beams come back."""
    for name, unsupported in (("logprobs", logprobs is not None), ("stop", bool(req.stop)),
                              ("prompt_logprobs", req.prompt_logprobs is not None)):
        if unsupported:
            raise bad_request(f"{name} is not supported with use_beam_search=true", name)
    for name in _NOT_FOR_BEAM_SEARCH:
        if getattr(req, name) != type(req).model_fields[name].default:
            raise bad_request(f"{name} is not used by beam search: leave it out with use_beam_search=true", name)
    try:
        params = BeamSearchParams(
            beam_width=req.n, max_tokens=max_tokens if max_tokens is not None else 1,
            ignore_eos=req.ignore_eos, temperature=req.temperature or 0.0, length_penalty=req.length_penalty,
        )
    except ValueError as e:
        param = "n" if "beam_width" in str(e) else "max_tokens" if "max_tokens" in str(e) else "temperature"
        raise bad_request(str(e).replace("beam_width", "n (the beam width)"), param) from None
    return BeamSearchRequest(params, max_tokens)


_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _structured_source(req: SamplingFields) -> str | None:
    """The one request field that asks for structured outputs (400 if several do)."""
    given = [
        name for name in ("response_format", "structured_outputs", *_GUIDED_FIELDS)
        if getattr(req, name) is not None
        and not (name == "response_format" and req.response_format.get("type") == "text")
    ]
    if len(given) > 1:
        raise bad_request(f"give only one of {', '.join(given)} (each asks for structured outputs)", given[1])
    return given[0] if given else None


def structured_outputs_from(req: SamplingFields) -> StructuredOutputsParams | None:
    """response_format, structured_outputs or a guided_* field -> StructuredOutputsParams."""
    source = _structured_source(req)
    if source is None:
        return None
    try:
        if source == "structured_outputs":
            return StructuredOutputsParams(**req.structured_outputs)
        if source in _GUIDED_FIELDS:
            return StructuredOutputsParams(**{_GUIDED_FIELDS[source]: getattr(req, source)})
        fmt = req.response_format
        kind = fmt.get("type")
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise ValueError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
            return StructuredOutputsParams(json=spec["schema"])
        if kind == "structural_tag":  # vLLM's: xgrammar's structural tag, this object itself
            return StructuredOutputsParams(structural_tag=fmt)
        raise ValueError(f"response_format type {kind!r} is not supported; "
                         "use text, json_object, json_schema or structural_tag")
    except TypeError as e:  # an unknown key in structured_outputs
        raise bad_request(f"{source}: {e}", source) from None
    except ValueError as e:
        raise bad_request(str(e), source) from None


async def check_structured_outputs(req: SamplingFields, params: SamplingParams | BeamSearchRequest) -> None:
    """Build the grammar (off the event loop: the first call loads xgrammar) so that an
    invalid schema, regex or grammar is a 400 naming the field, before anything is queued."""
    if isinstance(params, BeamSearchRequest) or params.structured_outputs is None:
        return
    from pagedllm.structured_output import validate

    try:
        await asyncio.to_thread(validate, params.structured_outputs)
    except ValueError as e:
        raise bad_request(str(e), _structured_source(req)) from None


async def tokenize_bad_words(engine: AsyncLLM, params: SamplingParams | BeamSearchRequest) -> None:
    """bad_words into token sequences on the tokenizer thread, not the event loop (the engine
    skips words already tokenized)."""
    if isinstance(params, SamplingParams) and params.bad_words:
        await engine.run_tokenizer(params.update_from_tokenizer, engine.tokenizer)


def check_stream_fields(req: SamplingFields) -> None:
    """Fields that only mean something in a stream, or not in one, as vLLM checks them."""
    options = req.stream_options
    if options is not None and not req.stream:
        raise bad_request("stream_options can only be given with stream=true", "stream_options")
    if options is not None and options.continuous_usage_stats and not options.include_usage:
        raise bad_request("stream_options.continuous_usage_stats needs include_usage=true", "stream_options")
    if req.stream and req.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs are not available with stream=true", "prompt_logprobs")


def continuous_usage(req: SamplingFields) -> bool:
    """Usage on every chunk of a stream (vLLM's stream_options.continuous_usage_stats)."""
    return req.stream_options is not None and req.stream_options.continuous_usage_stats


def usage_info(num_prompt: int, num_completion: int, num_cached: int | None = None) -> UsageInfo:
    """``num_cached``: the prompt tokens the prefix cache served (None: no details)."""
    details = None if num_cached is None else PromptTokensDetails(cached_tokens=num_cached)
    return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion, total_tokens=num_prompt + num_completion,
                     prompt_tokens_details=details)


def final_usage(outputs: list[RequestOutput], prompt_tokens_details: bool) -> UsageInfo:
    """A request's usage; with ``prompt_tokens_details`` (--enable-prompt-tokens-details),
    the prompt tokens the prefix cache served as ``prompt_tokens_details.cached_tokens``."""
    cached = sum(min(o.num_cached_tokens, len(o.prompt_token_ids)) for o in outputs)
    return usage_info(*usage_of(outputs), cached if prompt_tokens_details else None)


UNHONOURED_FIELDS = {
    "logits_processors": "custom logits processors are not supported",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported (return_token_ids gives the ids)",
    "vllm_xargs": "vllm_xargs (arguments for custom logits processors) is not supported",
    "prompt_embeds": "prompt embeddings are not supported; send text or token ids",
    "mm_processor_kwargs": "there are no multimodal models here",
    "functions": "legacy function calling is not supported: use tools",
    "function_call": "legacy function calling is not supported: use tool_choice",
    "suffix": "suffix (fill in the middle) is not supported",
}
"""OpenAI and vLLM request fields this engine cannot honour: a 400 naming them when set (the
one place for them; a field only one endpoint has is absent from the other's requests)."""


def check_unhonoured_fields(req: SamplingFields) -> None:
    for name, reason in UNHONOURED_FIELDS.items():
        if getattr(req, name, None) is not None:
            raise bad_request(f"{name}: {reason}", name)
    if getattr(req, "messages", None) is not None and getattr(req, "echo", False):
        raise bad_request("echo is not supported in chat completions (only in completions)", "echo")


def sampling_params_from(
    req: SamplingFields, max_tokens: int | None, logprobs: int | None,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams | BeamSearchRequest:
    """Map a request body onto SamplingParams (or beam search); an invalid value becomes a
    400 naming it. defaults: the server's generation defaults (generation_config.py), used
    for the sampling fields the request leaves out."""
    check_unhonoured_fields(req)
    structured_outputs = structured_outputs_from(req)
    if req.use_beam_search and structured_outputs is not None:
        raise bad_request("structured outputs cannot be combined with beam search", "use_beam_search")
    check_stream_fields(req)
    if req.use_beam_search:
        return beam_search_params_from(req, max_tokens, logprobs)
    if req.length_penalty != 1.0:
        raise bad_request(
            f"length_penalty={req.length_penalty} applies only to beam search (use_beam_search=true)",
            "length_penalty",
        )
    kwargs = _sampling_kwargs(req, max_tokens, logprobs, defaults or {})
    kwargs["structured_outputs"] = structured_outputs
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        match = re.match(r"(\w+)", str(e))
        param = match.group(1) if match and match.group(1) in kwargs else None
        raise bad_request(str(e), param) from None


def _sampling_kwargs(
    req: SamplingFields, max_tokens: int | None, logprobs: int | None, defaults: dict[str, Any]
) -> dict[str, Any]:
    """SamplingParams' arguments from the body's sampling fields (the server's defaults for
    those it leaves out), structured outputs aside."""

    def given_or_default(name: str, neutral: Any) -> Any:
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, neutral)

    return dict(
        n=req.n,
        max_tokens=max_tokens if max_tokens is not None else defaults.get("max_tokens"),
        min_tokens=req.min_tokens,
        temperature=given_or_default("temperature", 1.0),
        top_p=given_or_default("top_p", 1.0),
        top_k=given_or_default("top_k", None),
        min_p=given_or_default("min_p", 0.0),
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=given_or_default("repetition_penalty", 1.0),
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=req.prompt_logprobs,
        logit_bias=_logit_bias(req),
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
    )


def _logit_bias(req: SamplingFields) -> dict[int, float] | None:
    """The body's logit_bias with token-id keys; a 400 for a key that is not one."""
    if req.logit_bias is None:
        return None
    try:
        return {int(k): float(v) for k, v in req.logit_bias.items()}
    except ValueError:
        raise bad_request("logit_bias keys must be token ids (integers as strings)", "logit_bias") from None


def truncate_prompt(ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last k prompt tokens (-1: max_model_len)."""
    if truncate_prompt_tokens is None:
        return ids
    k = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    if not 1 <= k <= max_model_len:
        raise bad_request(
            f"truncate_prompt_tokens={truncate_prompt_tokens} must be -1 or between 1 and "
            f"max_model_len={max_model_len}", "truncate_prompt_tokens")
    return ids[-k:]


def check_context_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    if num_prompt_tokens >= max_model_len or (
        max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len
    ):
        asked = max_tokens or 0
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + asked} tokens ({num_prompt_tokens} in the prompt, "
            f"{asked} in the completion). Please reduce the prompt or max_tokens.",
            "max_tokens" if num_prompt_tokens < max_model_len else "prompt",
        )


# ---- logprobs ----------------------------------------------------------------------------

_MIN_LOGPROB = -9999.0  # JSON has no -inf


def _finite(x: float) -> float:
    return x if math.isfinite(x) else _MIN_LOGPROB


def _top(position: PositionLogprobs, k: int) -> list[tuple[int, Any]]:
    """The k best candidates at a position, by rank."""
    return sorted(position.items(), key=lambda kv: kv[1].rank)[:k]


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[PositionLogprobs],
    num_top: int,
    decode: Callable[[int], str],
    text_offset: int = 0,
) -> CompletionLogprobs:
    """OpenAI completions shape: tokens, token_logprobs, top_logprobs (k per position), text_offset."""
    out = CompletionLogprobs()
    offset = text_offset
    for token_id, position in zip(token_ids, logprobs):
        chosen = position.get(token_id)
        token = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None else decode(token_id)
        out.tokens.append(token)
        out.token_logprobs.append(_finite(chosen.logprob) if chosen is not None else None)
        top: dict[str, float] = {}
        for tid, lp in _top(position, num_top):
            top[lp.decoded_token if lp.decoded_token is not None else decode(tid)] = _finite(lp.logprob)
        out.top_logprobs.append(top if num_top > 0 else None)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def chat_logprobs(
    token_ids: list[int], logprobs: list[PositionLogprobs], num_top: int, decode: Callable[[int], str]
) -> list[ChatTokenLogprob]:
    """OpenAI chat shape: per token {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}."""
    content = []
    for token_id, position in zip(token_ids, logprobs):
        chosen = position.get(token_id)
        token = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None else decode(token_id)
        top = []
        for tid, lp in _top(position, num_top):
            t = lp.decoded_token if lp.decoded_token is not None else decode(tid)
            top.append(TopLogprob(token=t, logprob=_finite(lp.logprob), bytes=list(t.encode())))
        logprob = _finite(chosen.logprob) if chosen is not None else _MIN_LOGPROB
        content.append(ChatTokenLogprob(token=token, logprob=logprob, bytes=list(token.encode()), top_logprobs=top))
    return content


def prompt_logprobs_of(out: RequestOutput) -> PromptLogprobs | None:
    """vLLM's prompt_logprobs: per prompt token {token id: {logprob, rank, decoded_token}}, None first."""
    if out.prompt_logprobs is None:
        return None
    return [
        None if position is None else {
            token_id: PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
            for token_id, lp in position.items()
        }
        for position in out.prompt_logprobs
    ]


# ---- running prompts ---------------------------------------------------------------------


_ENGINE_CHECKED_FIELDS = frozenset({"kv_transfer_params", "priority", "logprobs", "prompt_logprobs",
                                    "thinking_token_budget"})


def response_model_name(base_name: str, lora_request: LoRARequest | None) -> str:
    """The `model` a response reports: the adapter's name when one served it (as vLLM), else the
    base model's first served name."""
    return lora_request.lora_name if lora_request is not None else base_name


def add_requests(
    engine: AsyncLLM, base_id: str, prompts: list[tuple[str | None, list[int]]],
    params: SamplingParams | BeamSearchRequest, cache_salt: str | None,
    kv_transfer_params: dict | None = None, *, priority: int = 0,
    request_logger: RequestLogger | None = None,
    lora_request: LoRARequest | None = None,
    mm_features: list[MultiModalFeature] | None = None,
) -> list[RequestStream]:
    """Queue one request per prompt; on a bad one, abort those already queued and raise a 400.
    Each queued request is logged by request_logger (--enable-log-requests). mm_features: the
    single prompt's images."""
    try:
        width = params.params.beam_width if isinstance(params, BeamSearchRequest) else params.n
        engine.check_admission(len(prompts) * width)
    except ValueError as e:
        raise bad_request(str(e), "n") from None
    streams: list[RequestStream] = []
    if kv_transfer_params is not None and len(prompts) != 1:
        raise bad_request("kv_transfer_params needs a single prompt", "kv_transfer_params")
    # Engine ids are the server's: the client's (or random) id plus a random suffix, so a
    # client-sent request_id cannot equal another request's engine id (say "0_<id>", a
    # sequence of an n > 1 request) nor a concurrent request's same id. Responses keep base_id.
    suffix = secrets.token_hex(8)
    try:
        for i, (text, ids) in enumerate(prompts):
            request_id = f"{base_id}-{suffix}" if len(prompts) == 1 else f"{base_id}-{i}-{suffix}"
            if isinstance(params, BeamSearchRequest):
                if kv_transfer_params is not None:
                    raise ValueError("kv_transfer_params cannot be combined with use_beam_search")
                if priority != 0:
                    raise ValueError("priority cannot be combined with use_beam_search")
                if lora_request is not None:
                    raise ValueError("a LoRA adapter cannot be combined with use_beam_search")
                if mm_features:
                    raise ValueError("images cannot be combined with use_beam_search yet")
                assert engine.model_config is not None
                beam = params.params_for(len(ids), engine.model_config.max_model_len)
                streams.append(engine.add_beam_search(request_id, text, beam, prompt_token_ids=ids))
            else:
                streams.append(engine.add_request(
                    request_id, text, params, prompt_token_ids=ids, cache_salt=cache_salt,
                    kv_transfer_params=kv_transfer_params, priority=priority, lora_request=lora_request,
                    mm_features=mm_features,
                ))
            if request_logger is not None:
                request_logger.log(request_id, text, ids, params.params if isinstance(params, BeamSearchRequest) else params)
    except ValueError as e:
        for s in streams:
            s.abort()
        message = str(e)
        first = re.match(r"\w+", message)  # the engine's messages name their field first
        param = first.group(0) if first and first.group(0) in _ENGINE_CHECKED_FIELDS else (
            "kv_transfer_params" if "kv_transfer_params" in message else "prompt")
        raise bad_request(message, param) from None
    except BaseException:
        for s in streams:
            s.abort()
        raise
    return streams


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the outputs of several requests as they come; abort all if stopped early."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].abort()
        return
    # Bounded: a pump waits while the consumer does not read, so each request's outputs merge
    # in its stream (one pending output each) instead of piling up here.
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue(maxsize=1)

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as e:  # handed to the consumer
            await queue.put((i, e))
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """The last (finished) output of every request, in prompt order."""
    results: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge_streams(streams):
        results[i] = out
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


def usage_of(outputs: list[RequestOutput]) -> tuple[int, int]:
    """(prompt tokens, completion tokens summed over every choice)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return prompt, completion


def choice_logprob_slice(c: CompletionOutput, start: int) -> tuple[list[int], list[PositionLogprobs]]:
    if c.logprobs is None:
        return [], []
    return c.token_ids[start:], c.logprobs[start:]
