"""The offline API: LLM(model=...).generate(prompts, sampling_params), as in vLLM."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from pagedllm.config import EngineConfig
from pagedllm.engine.arg_utils import DEFAULT_MODEL, EngineArgs
from pagedllm.engine.beam_search import BeamSearchDriver, BeamSearchOutput, BeamSearchParams
from pagedllm.engine.input_processor import PromptType
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.engine.pooling_inputs import cosine, pooling_token_ids, score_pairs
from pagedllm.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    """An engine for offline batched generation.

    Engine arguments are named like vLLM's: ``max_model_len``, ``block_size``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``kv_cache_memory_bytes``, ``dtype``,
    ``seed``, ``enable_prefix_caching``, ``quantization``, ``speculative_config`` (a dict as
    vLLM's, e.g. ``{"method": "ngram", "num_speculative_tokens": 4}``); ``kv_cache_backend``
    (a name in pagedllm/kv_backends/, with its own options: docs/kv_backends.md);
    ``attention_backend`` ("torch", "triton" or "reference"); ``device`` ("cpu", "cuda" or "auto"),
    ``gpu_memory_utilization`` and ``cuda_graph_sizes`` (docs/gpu.md); ``tensor_parallel_size`` and
    ``distributed_executor_backend`` ("mp" or "ray": docs/tensor_parallel.md; call ``shutdown()`` to
    stop the workers); ``reasoning_parser`` ("deepseek_r1", "qwen3": structured outputs start after
    the reasoning, docs/reasoning.md); ``scheduling_policy`` ("fcfs" or "priority"),
    ``generation_config`` / ``override_generation_config`` (sampling defaults:
    docs/vllm_compatibility.md), ``tokenizer``, ``max_logprobs``; ``enable_lora``, ``max_loras``,
    ``max_lora_rank``, ``max_cpu_loras`` (LoRA adapters per request: docs/lora.md).
    """

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args: Any) -> None:
        self.llm_engine = LLMEngine(EngineArgs(model=model, **engine_args).create_engine_config())

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> LLM:
        """An LLM over an already validated configuration (``EngineArgs.create_engine_config``)."""
        llm = cls.__new__(cls)
        llm.llm_engine = LLMEngine(config)
        return llm

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers, if any (they also stop with this process),
        and write the cached KV blocks to the disk offload tier, if any (docs/kv_offload.md)."""
        self.llm_engine.engine_core.shutdown()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation defaults (--generation-config,
        as vLLM): what generate and chat use when given no sampling_params."""
        return SamplingParams(**self.llm_engine.generation_defaults)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block (as vLLM); returns False if requests are running."""
        return self.llm_engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order. priority: one per
        prompt, lower first (needs scheduling_policy="priority"), as vLLM. lora_request: one
        adapter for every prompt, or one (or None: the base) per prompt (needs enable_lora)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        requests = [(p, None, None) for p in prompts]
        return self._run(requests, sampling_params, use_tqdm, priority, lora_request)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Chat: one conversation (a list of messages) or a list of conversations;
        ``chat_template_kwargs`` are variables for the template (e.g. ``enable_thinking``);
        ``tools`` (OpenAI's tool objects) are shown to the model through the template, the
        shipped tool template when the model's knows no tools (docs/tool_calling.md). Image
        parts ({"type": "image_url", "image_url": {"url": ...}} or {"type": "image_pil",
        "image_pil": PIL.Image}) go to a vision-language model (docs/multimodal.md)."""
        from pagedllm.entrypoints.openai.tool_parsers.chat_template import choose_chat_template

        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        processor = self.llm_engine.input_processor
        requests = []
        for conv in conversations:
            template = choose_chat_template(chat_template, processor.tokenizer.chat_template, conv, tools)
            requests.append(processor.render_chat_inputs(conv, template, add_generation_prompt, chat_template_kwargs,
                                                         tools))
        if self.llm_engine.reasoning_parser is not None:
            sampling_params = self._reasoning_states(requests, sampling_params, chat_template_kwargs)
        return self._run(requests, sampling_params, use_tqdm, lora_request=lora_request)

    def _reasoning_states(
        self, requests: list[Any], sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> SamplingParams | Sequence[SamplingParams] | None:
        """Per conversation, whether its grammar waits for the reasoning's end: the prompt and
        ``chat_template_kwargs`` (``enable_thinking``) decide, which the engine core cannot see."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(requests)
        parser = self.llm_engine.reasoning_parser
        assert parser is not None
        result = []
        for (text, *_), params in zip(requests, sampling_params):
            spec = params.structured_outputs
            if spec is not None and spec.reasoning_ended is None:
                ended = not parser.starts_in_reasoning(text, chat_template_kwargs)
                params = dataclasses.replace(params, structured_outputs=dataclasses.replace(spec, reasoning_ended=ended))
            result.append(params)
        return result

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """Beam search per prompt; each output holds its beams best first (as vLLM)."""
        if self.llm_engine.config.speculative_config is not None:
            raise ValueError(
                "beam search is not supported with speculative decoding; create the LLM "
                "without speculative_config to use beam_search"
            )
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        engine = self.llm_engine
        ids = [engine.input_processor.tokenize(p)[1] for p in prompts]
        return BeamSearchDriver(engine, params).run(ids)

    # ---- pooling models (embeddings, classification, scores) ----------------------------

    def encode(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        pooling_params: PoolingParams | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[PoolingRequestOutput]:
        """One output vector per prompt (a text or token ids): as ``pooling_params`` says
        (default: task "encode", the model's pooled vector, or a classifier's probabilities)."""
        params = pooling_params or PoolingParams(task="encode")
        items = [prompts] if isinstance(prompts, str) or _is_ids(prompts) else list(prompts)
        tokenizer, max_len = self.get_tokenizer(), self.llm_engine.model_config.max_model_len
        inputs = [
            (p if isinstance(p, str) else None, pooling_token_ids(tokenizer, p, max_len, truncate_prompt_tokens))
            for p in items
        ]
        return self._run_pooling(inputs, params, use_tqdm)

    def embed(
        self, prompts: str | list[int] | Sequence[str | list[int]], *, truncate_prompt_tokens: int | None = None,
        pooling_params: PoolingParams | None = None, use_tqdm: bool = False,
    ) -> list[PoolingRequestOutput]:
        """An embedding per prompt (``outputs.embedding``), pooled and normalized as the model says."""
        params = dataclasses.replace(pooling_params or PoolingParams(), task="embed")
        return self.encode(prompts, params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm)

    def classify(
        self, prompts: str | list[int] | Sequence[str | list[int]], *, truncate_prompt_tokens: int | None = None,
        pooling_params: PoolingParams | None = None, use_tqdm: bool = False,
    ) -> list[PoolingRequestOutput]:
        """A classifier's probabilities per prompt (``outputs.probs``)."""
        params = dataclasses.replace(pooling_params or PoolingParams(), task="classify")
        return self.encode(prompts, params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm)

    def score(
        self, data_1: str | Sequence[str], data_2: str | Sequence[str], *,
        truncate_prompt_tokens: int | None = None, use_tqdm: bool = False,
    ) -> list[PoolingRequestOutput]:
        """The score (``outputs.score``) of each pair: one text against many, or pairwise. A
        cross-encoder reads each pair as one prompt; an embedding model scores the cosine
        similarity of the two embeddings."""
        pairs = score_pairs(data_1, data_2)
        model_config = self.llm_engine.model_config
        tokenizer, max_len = self.get_tokenizer(), model_config.max_model_len
        if model_config.num_labels is not None:
            inputs = [(None, pooling_token_ids(tokenizer, a, max_len, truncate_prompt_tokens, pair=b)) for a, b in pairs]
            return self._run_pooling(inputs, PoolingParams(task="score"), use_tqdm)
        texts = sorted({t for pair in pairs for t in pair})
        vectors = dict(zip(texts, self.embed(texts, truncate_prompt_tokens=truncate_prompt_tokens)))
        return [
            PoolingRequestOutput(str(i), None, vectors[a].prompt_token_ids + vectors[b].prompt_token_ids,
                                 PoolingOutput([cosine(vectors[a].outputs.data, vectors[b].outputs.data)]))
            for i, (a, b) in enumerate(pairs)
        ]

    def _run_pooling(
        self, inputs: list[tuple[str | None, list[int]]], params: PoolingParams, use_tqdm: bool
    ) -> list[PoolingRequestOutput]:
        engine = self.llm_engine
        order: dict[str, int] = {}
        try:
            for i, (text, ids) in enumerate(inputs):
                order[engine.add_request(text or "", params, prompt_token_ids=ids)] = i
        except Exception:
            engine.abort_request(list(order))
            raise
        results: list[PoolingRequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[order[out.request_id]] = out  # type: ignore[call-overload]
                    bar.update(1)
        bar.close()
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def _run(
        self,
        requests: list[tuple[PromptType, list[int] | None, list[MultiModalFeature] | None]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        loras = _per_prompt(lora_request, LoRARequest, len(requests), "lora_requests")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if priority is not None and len(priority) != len(requests):
            raise ValueError(f"got {len(priority)} priorities for {len(requests)} prompts; pass one per prompt")
        priorities = list(priority) if priority is not None else [0] * len(requests)
        params = _per_prompt(sampling_params, SamplingParams, len(requests), "SamplingParams")
        engine = self.llm_engine
        order: dict[str, int] = {}
        try:
            for i, ((prompt, ids, mm), p, prio, lora) in enumerate(zip(requests, params, priorities, loras)):
                salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
                order[engine.add_request(prompt, p, prompt_token_ids=ids, cache_salt=salt, priority=prio,
                                         lora_request=lora, mm_features=mm)] = i
        except Exception:
            engine.abort_request(list(order))  # a bad prompt: nothing half-queued stays behind
            raise
        return self._run_engine(order, use_tqdm)

    def _run_engine(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: list[RequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start = time.perf_counter()
        num_in = num_out = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[order[out.request_id]] = out
                    num_in += len(out.prompt_token_ids)
                    num_out += sum(len(c.token_ids) for c in out.outputs)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(
                        f"est. speed input: {num_in / elapsed:.2f} toks/s, "
                        f"output: {num_out / elapsed:.2f} toks/s"
                    )
                    bar.update(1)
        bar.close()
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) for t in value)


def _per_prompt(value: Any, single: type, num_prompts: int, what: str) -> list[Any]:
    """One value per prompt, from one ``single`` (or None) for all or a sequence of one per
    prompt (ValueError naming ``what`` otherwise): sampling params, LoRA adapters."""
    if value is None or isinstance(value, single):
        return [value] * num_prompts
    values = list(value)
    if len(values) != num_prompts:
        raise ValueError(f"got {len(values)} {what} for {num_prompts} prompts; pass one, or one per prompt")
    return values
