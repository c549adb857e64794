"""The pooling routes' work: inputs to token ids (off the event loop), one pooling request
per input queued together, their outputs in the routes' shapes. Scores come from a
cross-encoder reading each (query, document) pair as one prompt, or, for an embedding model,
from the cosine similarity of the two embeddings (as vLLM)."""

from __future__ import annotations

import asyncio
import base64
import secrets
import struct
from typing import Any

from pagedllm.engine.async_llm import AsyncLLM, RequestStream
from pagedllm.engine.pooling_inputs import cosine, pooling_token_ids, score_pairs
from pagedllm.entrypoints.openai.pooling_protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    as_inputs,
)
from pagedllm.entrypoints.openai.serving_base import bad_request
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams

Prompt = tuple[str | None, list[int]]


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """float: the list; base64: little-endian float32 bytes in base64 (OpenAI's)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def _param_of(message: str, default: str) -> str:
    return "truncate_prompt_tokens" if "truncate_prompt_tokens" in message else default


class OpenAIServingPooling:
    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    # ---- shared ------------------------------------------------------------------------

    async def _prompts(self, inputs: list[Any], truncate: int | None, field: str,
                       pairs: list[str] | None = None) -> list[Prompt]:
        """(text, ids) per input (with ``pairs``: each input joined with its pair's text)."""
        assert self.engine.model_config is not None
        max_len = self.engine.model_config.max_model_len
        if not inputs:
            raise bad_request(f"{field} is empty: give at least one input", field)
        tokenizer = self.engine.tokenizer

        def tokenize() -> list[Prompt]:
            return [
                (x if isinstance(x, str) else None,
                 pooling_token_ids(tokenizer, x, max_len, truncate, pair=None if pairs is None else pairs[i]))
                for i, x in enumerate(inputs)
            ]

        try:
            return await self.engine.run_tokenizer(tokenize)
        except ValueError as e:
            raise bad_request(str(e), _param_of(str(e), field)) from None

    async def _pool(self, prompts: list[Prompt], params: PoolingParams, priority: int,
                    field: str) -> list[PoolingRequestOutput]:
        """Queue one request per prompt (all or none: a bad one aborts the queued, a 400), then
        wait for every output."""
        try:
            self.engine.check_admission(len(prompts))
        except ValueError as e:
            raise bad_request(str(e), field) from None
        suffix = secrets.token_hex(8)
        streams: list[RequestStream] = []
        try:
            for i, (text, ids) in enumerate(prompts):
                streams.append(self.engine.add_pooling_request(f"pool-{i}-{suffix}", text, ids, params, priority))
        except ValueError as e:
            for s in streams:
                s.abort()
            raise bad_request(str(e), _param_of(str(e), field)) from None
        try:
            return list(await asyncio.gather(*(_final(s) for s in streams)))
        finally:
            for s in streams:
                s.abort()

    @staticmethod
    def _usage(outputs: list[PoolingRequestOutput]) -> PoolingUsage:
        n = sum(len(o.prompt_token_ids) for o in outputs)
        return PoolingUsage(prompt_tokens=n, total_tokens=n)

    # ---- routes ------------------------------------------------------------------------

    async def embeddings(self, req: EmbeddingRequest) -> EmbeddingResponse:
        if req.dimensions is not None and req.dimensions < 1:
            raise bad_request(f"dimensions={req.dimensions} must be >= 1", "dimensions")
        prompts = await self._prompts(as_inputs(req.input), req.truncate_prompt_tokens, "input")
        params = PoolingParams(task="embed", normalize=req.normalize, dimensions=req.dimensions)
        outputs = await self._pool(prompts, params, req.priority, "input")
        if req.dimensions is not None and outputs and len(outputs[0].outputs.data) < req.dimensions:
            raise bad_request(
                f"dimensions={req.dimensions} is more than this model's {len(outputs[0].outputs.data)}", "dimensions")
        data = [EmbeddingData(index=i, embedding=encode_vector(o.outputs.data, req.encoding_format))
                for i, o in enumerate(outputs)]
        return EmbeddingResponse(model=self.model_name, data=data, usage=self._usage(outputs))

    async def pooling(self, req: PoolingRequest) -> PoolingResponse:
        prompts = await self._prompts(as_inputs(req.input), req.truncate_prompt_tokens, "input")
        outputs = await self._pool(prompts, PoolingParams(task="encode"), req.priority, "input")
        data = [PoolingData(index=i, data=encode_vector(o.outputs.data, req.encoding_format))
                for i, o in enumerate(outputs)]
        return PoolingResponse(model=self.model_name, data=data, usage=self._usage(outputs))

    async def classify(self, req: ClassificationRequest) -> ClassificationResponse:
        prompts = await self._prompts(as_inputs(req.input), req.truncate_prompt_tokens, "input")
        outputs = await self._pool(prompts, PoolingParams(task="classify"), req.priority, "input")
        assert self.engine.model_config is not None
        labels = self.engine.model_config.labels
        data = []
        for i, o in enumerate(outputs):
            probs = o.outputs.data
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(ClassificationData(index=i, label=labels[best] if best < len(labels) else None,
                                           probs=probs, num_classes=len(probs)))
        return ClassificationResponse(model=self.model_name, data=data, usage=self._usage(outputs))

    async def score(self, req: ScoreRequest) -> ScoreResponse:
        first = req.text_1 if req.text_1 is not None else req.data_1
        second = req.text_2 if req.text_2 is not None else req.data_2
        if first is None or second is None:
            raise bad_request("give text_1 and text_2 (or data_1 and data_2)", "text_1" if first is None else "text_2")
        try:
            pairs = score_pairs(first, second)
        except ValueError as e:
            raise bad_request(str(e), "text_2") from None
        scores, usage = await self._scores(pairs, req.truncate_prompt_tokens, req.priority, "text_1")
        data = [ScoreData(index=i, score=s) for i, s in enumerate(scores)]
        return ScoreResponse(model=self.model_name, data=data, usage=usage)

    async def rerank(self, req: RerankRequest) -> RerankResponse:
        if not req.documents:
            raise bad_request("documents is empty: give at least one document", "documents")
        if req.top_n is not None and req.top_n < 0:
            raise bad_request(f"top_n={req.top_n} must be >= 0", "top_n")
        scores, usage = await self._scores(
            [(req.query, d) for d in req.documents], req.truncate_prompt_tokens, req.priority, "documents")
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if req.top_n:
            order = order[: req.top_n]
        results = [
            RerankResult(index=i, relevance_score=scores[i],
                         document=RerankDocument(text=req.documents[i]) if req.return_documents else None)
            for i in order
        ]
        return RerankResponse(model=self.model_name, usage=RerankUsage(total_tokens=usage.total_tokens),
                              results=results)

    async def _scores(self, pairs: list[tuple[str, str]], truncate: int | None, priority: int,
                      field: str) -> tuple[list[float], PoolingUsage]:
        """A score per pair: the cross-encoder's, or the cosine of the two embeddings."""
        assert self.engine.model_config is not None
        if self.engine.model_config.num_labels is not None:
            prompts = await self._prompts([a for a, _ in pairs], truncate, field, pairs=[b for _, b in pairs])
            outputs = await self._pool(prompts, PoolingParams(task="score"), priority, field)
            return [o.outputs.score for o in outputs], self._usage(outputs)
        texts = sorted({t for pair in pairs for t in pair})
        prompts = await self._prompts(texts, truncate, field)
        outputs = await self._pool(prompts, PoolingParams(task="embed"), priority, field)
        vectors = {t: o.outputs.data for t, o in zip(texts, outputs)}
        return [cosine(vectors[a], vectors[b]) for a, b in pairs], self._usage(outputs)


async def _final(stream: RequestStream) -> PoolingRequestOutput:
    async for output in stream:
        if output.finished:
            return output  # type: ignore[return-value]
    raise RuntimeError(f"pooling request {stream.request_id!r} ended without an output")
