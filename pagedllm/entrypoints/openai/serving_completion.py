"""POST /v1/completions: prompts as text, token ids, or lists of either; echo; streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pagedllm.engine.async_llm import AsyncLLM, EngineNotReadyError, RequestFaultError
from pagedllm.engine.input_processor import PromptTooLongError
from pagedllm.entrypoints.openai.limits import check_list_caps
from pagedllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from pagedllm.entrypoints.openai.request_logger import RequestLogger
from pagedllm.entrypoints.openai.serving_base import (
    SSE_DONE,
    add_requests,
    response_model_name,
    bad_request,
    engine_error,
    check_context_length,
    check_structured_outputs,
    choice_logprob_slice,
    completion_logprobs,
    continuous_usage,
    final_outputs,
    final_usage,
    merge_streams,
    prompt_logprobs_of,
    sampling_params_from,
    sse,
    tokenize_bad_words,
    truncate_prompt,
    usage_info,
)
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput


class OpenAIServingCompletion:
    def __init__(self, engine: AsyncLLM, model_name: str, request_logger: RequestLogger | None = None,
                 prompt_tokens_details: bool = False) -> None:
        self.engine = engine
        self.model_name = model_name
        self.request_logger = request_logger
        self.prompt_tokens_details = prompt_tokens_details
        """--enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens."""

    async def _prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) per prompt; tokenized off the event loop."""
        p = req.prompt
        if isinstance(p, str):
            raw: list = [p]
        elif not p:
            raise bad_request("prompt must not be empty", "prompt")
        elif isinstance(p[0], int):
            raw = [p]
        else:
            raw = list(p)
        prompts = []
        for i, item in enumerate(raw):
            if isinstance(item, str):
                try:
                    prompts.append((item, await self.engine.encode(item, req.add_special_tokens)))
                except PromptTooLongError as e:
                    raise bad_request(str(e) if len(raw) == 1 else f"prompt {i}: {e}", "prompt") from None
            else:
                prompts.append((None, list(item)))
        if req.truncate_prompt_tokens is not None:
            assert self.engine.model_config is not None
            max_len = self.engine.model_config.max_model_len
            truncated = []
            for text, ids in prompts:
                kept = truncate_prompt(ids, req.truncate_prompt_tokens, max_len)
                truncated.append((text if len(kept) == len(ids) else None, kept))  # echo decodes what is kept
            prompts = truncated
        return prompts

    def _check(self, req: CompletionRequest) -> None:
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of is not supported (as in vLLM V1); use n", "best_of")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo together with logprobs (prompt logprobs) is not supported yet", "echo")

    async def create(
        self, req: CompletionRequest, lora_request: LoRARequest | None = None
    ) -> CompletionResponse | AsyncIterator[str]:
        check_list_caps(req)
        self._check(req)
        defaults = self.engine.generation_defaults
        # Left out: the checkpoint's default, else OpenAI's 16 (null: the default, else the room left).
        max_tokens = req.max_tokens if "max_tokens" in req.model_fields_set else defaults.get("max_tokens", 16)
        params = sampling_params_from(req, max_tokens, req.logprobs, defaults)
        await check_structured_outputs(req, params)
        await tokenize_bad_words(self.engine, params)
        prompts = await self._prompts(req)
        assert self.engine.model_config is not None
        for _, ids in prompts:
            check_context_length(len(ids), max_tokens, self.engine.model_config.max_model_len)
        request_id = req.request_id or random_id("cmpl")
        model = response_model_name(self.model_name, lora_request)
        streams = add_requests(self.engine, request_id, prompts, params, req.cache_salt, req.kv_transfer_params,
                               priority=req.priority, request_logger=self.request_logger, lora_request=lora_request)
        if req.stream:
            return self._stream(req, request_id, model, prompts, streams)
        try:
            outputs = await final_outputs(streams)
        except (EngineNotReadyError, RequestFaultError) as e:
            raise engine_error(e) from None
        return self._response(req, request_id, model, prompts, outputs)

    def _prompt_text(self, prompt: tuple[str | None, list[int]]) -> str:
        text, ids = prompt
        return text if text is not None else self.engine.tokenizer.decode(ids)

    def _decode(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def _response(
        self, req: CompletionRequest, request_id: str, model: str, prompts: list, outputs: list[RequestOutput]
    ) -> CompletionResponse:
        choices = []
        for i, out in enumerate(outputs):
            prefix = self._prompt_text(prompts[i]) if req.echo else ""
            prompt_logprobs = prompt_logprobs_of(out)  # every choice of a prompt carries its prompt's
            for c in out.outputs:
                logprobs = None
                if req.logprobs is not None and c.logprobs is not None:
                    logprobs = completion_logprobs(c.token_ids, c.logprobs, req.logprobs, self._decode, len(prefix))
                choices.append(CompletionChoice(
                    index=i * req.n + c.index, text=prefix + c.text, logprobs=logprobs,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason, prompt_logprobs=prompt_logprobs,
                    prompt_token_ids=list(out.prompt_token_ids) if req.return_token_ids else None,
                    token_ids=list(c.token_ids) if req.return_token_ids else None,
                ))
        usage = final_usage(outputs, self.prompt_tokens_details)
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage,
                                  kv_transfer_params=outputs[0].kv_transfer_params if outputs else None)

    async def _stream(self, req: CompletionRequest, request_id: str, model: str, prompts: list, streams) -> AsyncIterator[str]:
        sent_text: dict[int, int] = {}  # choice index -> chars sent
        sent_tokens: dict[int, int] = {}
        sent_prompt: set[int] = set()  # choices whose prompt_token_ids went out (return_token_ids)
        last: dict[int, RequestOutput] = {}
        continuous = continuous_usage(req)
        try:
            async for i, out in merge_streams(streams):
                last[i] = out
                for c in out.outputs:
                    index = i * req.n + c.index
                    first = index not in sent_text
                    delta = c.text[sent_text.get(index, 0):]
                    if first and req.echo:
                        delta = self._prompt_text(prompts[i]) + delta
                    if not delta and c.finish_reason is None and not first:
                        continue
                    start = sent_tokens.get(index, 0)
                    logprobs = None
                    if req.logprobs is not None and c.logprobs is not None:
                        ids, lps = choice_logprob_slice(c, start)
                        logprobs = completion_logprobs(ids, lps, req.logprobs, self._decode, sent_text.get(index, 0))
                    sent_text[index] = len(c.text)
                    sent_tokens[index] = len(c.token_ids)
                    ids = req.return_token_ids
                    if not delta and c.finish_reason is None and not (ids and len(c.token_ids) > start):
                        continue
                    # Continuous usage, as vLLM: this choice's prompt and its tokens so far.
                    usage = usage_info(len(out.prompt_token_ids), len(c.token_ids)) if continuous else None
                    chunk = CompletionResponse(id=request_id, model=model, choices=[CompletionChoice(
                        index=index, text=delta, logprobs=logprobs,
                        finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                        prompt_token_ids=list(out.prompt_token_ids) if ids and index not in sent_prompt else None,
                        token_ids=list(c.token_ids[start:]) if ids else None,
                    )], usage=usage)
                    sent_prompt.add(index)
                    yield sse(chunk)
            if req.stream_options is not None and req.stream_options.include_usage:
                usage = final_usage(list(last.values()), self.prompt_tokens_details)
                yield sse(CompletionResponse(id=request_id, model=model, choices=[], usage=usage))
        except (EngineNotReadyError, RequestFaultError) as e:
            yield sse(engine_error(e).to_response())
        yield SSE_DONE
