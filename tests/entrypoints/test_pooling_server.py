"""The pooling routes on a real server process: the official `openai` client's
`embeddings.create` and LangChain's `OpenAIEmbeddings` against a BERT embedder (vectors equal to
sentence-transformers' on the same checkpoint), `/pooling`, `/score` and the rerank routes
against a cross-encoder (scores equal to sentence-transformers' CrossEncoder), errors in
OpenAI's shape, the pooling metric, and a causal model serving completions and embeddings
at once."""

from __future__ import annotations

import base64
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F

from tests.entrypoints.utils import RemoteServer, metric_value

pytestmark = pytest.mark.slow  # four server processes (one shared)
from tests.models.pooling_utils import TEXTS, save_decoder, save_encoder

ARGS = ["--dtype", "float32", "--kv-cache-memory-bytes", "16MiB", "--max-num-seqs", "8"]
QUERY = "what is the capital of france?"


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bert-embedder")
    save_encoder(path, "BertModel", "mean", normalize=True)
    return path


@pytest.fixture(scope="module")
def embedder(embedder_dir: Path):
    srv = RemoteServer([*ARGS, "--served-model-name", "emb"], model=str(embedder_dir))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bert-reranker")
    save_encoder(path, "BertForSequenceClassification", num_labels=1)
    return path


@pytest.fixture(scope="module")
def reranker(reranker_dir: Path):
    srv = RemoteServer([*ARGS, "--served-model-name", "rr"], model=str(reranker_dir))
    yield srv
    srv.stop()


def _reference_embeddings(path: Path, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_tensor=True).float()


def _assert_close(ours: list[list[float]], ref: torch.Tensor) -> None:
    cosine = F.cosine_similarity(torch.tensor(ours), ref, dim=-1)
    assert bool((cosine > 0.9999).all()), cosine


def test_openai_client_embeddings(embedder, embedder_dir: Path) -> None:
    client = openai.OpenAI(base_url=embedder.base_url, api_key="none")
    ref = _reference_embeddings(embedder_dir, TEXTS)
    # The client's default asks for base64 and decodes it.
    out = client.embeddings.create(model="emb", input=TEXTS)
    assert [d.index for d in out.data] == list(range(len(TEXTS)))
    _assert_close([d.embedding for d in out.data], ref)
    floats = client.embeddings.create(model="emb", input=TEXTS[0], encoding_format="float")
    _assert_close([floats.data[0].embedding], ref[:1])
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(embedder_dir))(TEXTS)["input_ids"]
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(len(i) for i in ids)
    # Token ids in, the same vectors out.
    by_ids = client.embeddings.create(model="emb", input=ids[:2], encoding_format="float")
    _assert_close([d.embedding for d in by_ids.data], ref[:2])
    # dimensions: the first 16 values, renormalized.
    cut = client.embeddings.create(model="emb", input=TEXTS[0], dimensions=16, encoding_format="float")
    assert len(cut.data[0].embedding) == 16
    assert torch.allclose(torch.tensor(cut.data[0].embedding), F.normalize(ref[0, :16], dim=0), atol=1e-4)


def test_base64_is_little_endian_float32(embedder) -> None:
    body = httpx.post(embedder.url + "/v1/embeddings",
                      json={"model": "emb", "input": TEXTS[1], "encoding_format": "base64"}).json()
    raw = base64.b64decode(body["data"][0]["embedding"])
    floats = httpx.post(embedder.url + "/v1/embeddings", json={"model": "emb", "input": TEXTS[1]}).json()
    vector = floats["data"][0]["embedding"]
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(vector, abs=1e-6)
    assert body["object"] == "list" and body["model"] == "emb" and body["data"][0]["object"] == "embedding"


def test_langchain_openai_embeddings(embedder, embedder_dir: Path) -> None:
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: send the texts, not OpenAI's tiktoken ids (as with vLLM).
    embeddings = OpenAIEmbeddings(model="emb", base_url=embedder.base_url, api_key="none",
                                  check_embedding_ctx_length=False)
    ref = _reference_embeddings(embedder_dir, TEXTS)
    _assert_close(embeddings.embed_documents(TEXTS), ref)
    _assert_close([embeddings.embed_query(TEXTS[3])], ref[3:4])


def test_errors_in_openai_shape(embedder) -> None:
    client = openai.OpenAI(base_url=embedder.base_url, api_key="none")
    too_long = " ".join(["hello world"] * 100)  # past max_model_len (128)
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="emb", input=[TEXTS[0], too_long])
    error = info.value.body
    assert error["param"] == "truncate_prompt_tokens" and "truncate_prompt_tokens" in error["message"]
    out = client.embeddings.create(model="emb", input=too_long, extra_body={"truncate_prompt_tokens": -1})
    assert out.usage.prompt_tokens == 127
    with pytest.raises(openai.BadRequestError, match="pooling model"):
        client.completions.create(model="emb", prompt="hello", max_tokens=2)
    response = httpx.post(embedder.url + "/classify", json={"model": "emb", "input": "hello"})
    assert response.status_code == 400 and "no classifier" in response.json()["error"]["message"]


def test_pooling_route_and_metric(embedder) -> None:
    body = httpx.post(embedder.url + "/pooling", json={"model": "emb", "input": [TEXTS[0], TEXTS[1]]}).json()
    assert [d["object"] for d in body["data"]] == ["pooling", "pooling"] and len(body["data"][0]["data"]) == 64
    text = httpx.get(embedder.url + "/metrics").text
    assert metric_value(text, "pagedllm:pooling_requests_total", {"task": "encode"}) >= 2
    assert metric_value(text, "pagedllm:pooling_requests_total", {"task": "embed"}) >= 1


def test_score_and_rerank_equal_cross_encoder(reranker, reranker_dir: Path) -> None:
    from sentence_transformers import CrossEncoder

    ref = CrossEncoder(str(reranker_dir), device="cpu").predict([(QUERY, t) for t in TEXTS]).tolist()
    score = httpx.post(reranker.url + "/score", json={"model": "rr", "text_1": QUERY, "text_2": TEXTS}).json()
    assert [d["score"] for d in score["data"]] == pytest.approx(ref, abs=1e-4)
    best = sorted(range(len(TEXTS)), key=lambda i: -ref[i])
    for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = httpx.post(reranker.url + route, json={
            "model": "rr", "query": QUERY, "documents": TEXTS, "top_n": 2}).json()
        assert [r["index"] for r in body["results"]] == best[:2]
        assert [r["relevance_score"] for r in body["results"]] == pytest.approx([ref[i] for i in best[:2]], abs=1e-4)
        assert body["results"][0]["document"]["text"] == TEXTS[best[0]]
        assert body["usage"]["total_tokens"] > 0
    bare = httpx.post(reranker.url + "/rerank", json={
        "model": "rr", "query": QUERY, "documents": TEXTS, "return_documents": False}).json()
    assert len(bare["results"]) == len(TEXTS) and "document" not in bare["results"][0]
    classify = httpx.post(reranker.url + "/classify", json={"model": "rr", "input": TEXTS[:2]}).json()
    assert classify["data"][0]["num_classes"] == 1 and classify["data"][0]["label"] == "LABEL_0"


def test_qwen3_reranker_served_with_vllms_hf_overrides(tmp_path: Path) -> None:
    """A Qwen3ForCausalLM started with vLLM's Qwen3-Reranker line (--hf-overrides; the tiny
    tokenizer's single-token "n" / "y" for "no" / "yes"): /rerank's relevance is
    sigmoid(logit_yes - logit_no) of transformers' causal LM on the (query, document) prompt."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    save_decoder(tmp_path, "Qwen3ForCausalLM")
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["n", "y"],
                 "is_original_qwen3_reranker": True}
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    no, yes = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("n", "y"))
    ref = []
    for text in TEXTS:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokenizer(QUERY, text)["input_ids"]])).logits[0, -1]
        ref.append(torch.sigmoid(logits[yes] - logits[no]).item())
    srv = RemoteServer([*ARGS, "--served-model-name", "qr", "--runner", "pooling",
                        "--hf-overrides", json.dumps(overrides)], model=str(tmp_path))
    try:
        body = httpx.post(srv.url + "/v2/rerank", json={"model": "qr", "query": QUERY, "documents": TEXTS}).json()
    finally:
        srv.stop()
    best = sorted(range(len(TEXTS)), key=lambda i: -ref[i])
    assert [r["index"] for r in body["results"]] == best
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx([ref[i] for i in best], abs=1e-4)


def test_causal_model_serves_completions_and_embeddings(server) -> None:
    """The shared SmolLM2 server (generate runner) answers an embedding request while it
    generates: last-token pooling, unit length, the same vector as when alone."""
    client = openai.OpenAI(base_url=server.base_url, api_key="none")
    alone = client.embeddings.create(model="SmolLM2-135M-Instruct", input="The sky is", encoding_format="float")
    with ThreadPoolExecutor(2) as pool:
        completion = pool.submit(client.completions.create, model="SmolLM2-135M-Instruct",
                                 prompt="Once upon a time", max_tokens=32, temperature=0.0)
        embedding = pool.submit(client.embeddings.create, model="SmolLM2-135M-Instruct", input="The sky is",
                                encoding_format="float")
        text = completion.result().choices[0].text
        vector = embedding.result().data[0].embedding
    assert text
    assert len(vector) == 576 and sum(v * v for v in vector) == pytest.approx(1.0, abs=1e-4)
    assert vector == pytest.approx(alone.data[0].embedding, abs=1e-4)
