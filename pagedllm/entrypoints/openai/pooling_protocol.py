"""Request and response bodies of the pooling routes: OpenAI's `/v1/embeddings`, and vLLM's
`/pooling`, `/classify`, `/score` and `/rerank` (Jina / Cohere shapes)."""

from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import BaseModel, Field

from pagedllm.entrypoints.openai.protocol import RequestModel, random_id

# A text, texts, token ids, or lists of token ids (OpenAI's `input`).
PoolingInput = Union[str, list[str], list[int], list[list[int]]]


class PoolingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingRequest(RequestModel):
    model: str | None = None
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    """Keep the first `dimensions` values of each embedding (Matryoshka), renormalized."""
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    priority: int = 0


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("embd"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class PoolingRequest(RequestModel):
    model: str | None = None
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("pool"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: PoolingUsage


class ClassificationRequest(RequestModel):
    model: str | None = None
    input: PoolingInput
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class ClassificationData(BaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("classify"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


class ScoreRequest(RequestModel):
    """`text_1` scored against `text_2`: one against many, or pairwise (vLLM's /score)."""

    model: str | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    data_1: str | list[str] | None = None
    """vLLM's newer names of text_1 / text_2."""
    data_2: str | list[str] | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("score"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankRequest(RequestModel):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None
    """The best `top_n` documents (None or 0: all), best first."""
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int = 0


class RerankResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("rerank"))
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def as_inputs(value: Any) -> list[str | list[int]]:
    """OpenAI's `input` as a list of texts or token-id lists."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        return [value]
    return list(value)
