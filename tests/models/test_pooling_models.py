"""Pooling models through the real engine (LLM.embed / classify / score) against
sentence-transformers and transformers on tiny random checkpoints of each family: embeddings
at cosine > 0.9999 in float32 with the pooling and normalization read from the checkpoint's
sentence-transformers files, classifier outputs within 1e-4, a mixed-length batch giving each
text its vector alone, --pooler-config over the checkpoint's pooling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM, PoolingParams
from pagedllm.models import registry
from tests.models.pooling_utils import TEXTS, hf_hidden, save_decoder, save_encoder
from tests.models.utils import convert_with_llama_cpp, llama_cpp_dir

COSINE = 0.9999
SCORE_TOL = 1e-4
PAIRS = [("what is the capital of france?", t) for t in TEXTS]

# Every pooling family's architecture, with the test below that covers it.
COVERED = {
    "BertModel": "test_encoder_embeddings_equal_sentence_transformers",
    "XLMRobertaModel": "test_encoder_embeddings_equal_sentence_transformers",
    "BertForSequenceClassification": "test_cross_encoder_scores_equal_sentence_transformers",
    "XLMRobertaForSequenceClassification": "test_classifier_probabilities_equal_transformers",
    "Qwen3ForSequenceClassification": "test_classifier_probabilities_equal_transformers",
    "LlamaForSequenceClassification": "test_classifier_probabilities_equal_transformers",
    "Qwen2ForSequenceClassification": "test_classifier_probabilities_equal_transformers",
    "Qwen3Model": "test_decoder_embedder_equals_sentence_transformers",
    "LlamaModel": "test_decoder_embedder_equals_sentence_transformers",
    "Qwen2Model": "test_decoder_embedder_equals_sentence_transformers",
}


def _llm(path: Path, **kwargs: Any) -> LLM:
    # float32 matmuls throughout (the CPU's default runs long prompts' matmuls in bf16).
    return LLM(str(path), dtype="float32", matmul_activations="float32", kv_cache_memory_bytes="8MiB", **kwargs)


def _embeddings(llm: LLM, texts: list[str], **kwargs: Any) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in llm.embed(texts, **kwargs)])


def _assert_cosine(ours: torch.Tensor, ref: torch.Tensor) -> None:
    cosine = F.cosine_similarity(ours, ref.float(), dim=-1)
    assert bool((cosine > COSINE).all()), cosine


def test_every_pooling_family_has_a_case() -> None:
    pooling = {a for f in registry.families() if f.runner == "pooling" for a in f.architectures}
    assert pooling <= set(COVERED), pooling - set(COVERED)


@pytest.mark.parametrize(
    "architecture, pooling, normalize",
    [("BertModel", "mean", True), ("BertModel", "cls", False), ("XLMRobertaModel", "mean", True)],
)
def test_encoder_embeddings_equal_sentence_transformers(
    tmp_path: Path, architecture: str, pooling: str, normalize: bool
) -> None:
    from sentence_transformers import SentenceTransformer

    save_encoder(tmp_path, architecture, pooling, normalize)
    ref = SentenceTransformer(str(tmp_path), device="cpu").encode(TEXTS, convert_to_tensor=True)
    llm = _llm(tmp_path)
    ours = _embeddings(llm, TEXTS)
    _assert_cosine(ours, ref)
    norms = ours.norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-5) == normalize, norms
    # An embedding model's score of a pair: the cosine of the two embeddings.
    scores = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS[1:])]
    assert scores == pytest.approx(F.cosine_similarity(ref[:1], ref[1:], dim=-1).tolist(), abs=1e-4)
    # The mixed-length batch above gave each text what it gets alone (no padding leaks).
    for i, text in enumerate(TEXTS):
        alone = _embeddings(llm, [text])[0]
        assert F.cosine_similarity(alone, ours[i], dim=0) > COSINE
        assert torch.allclose(alone, ours[i], atol=1e-4), (alone - ours[i]).abs().max()


def test_pooler_config_overrides_the_checkpoint(tmp_path: Path) -> None:
    """A CLS, unnormalized checkpoint served with --pooler-config MEAN + normalize: the mean of
    transformers' hidden states, normalized."""
    from transformers import AutoTokenizer, BertModel

    save_encoder(tmp_path, "BertModel", "cls", normalize=False)
    model = BertModel.from_pretrained(str(tmp_path)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    ref = torch.stack([F.normalize(hf_hidden(model, tokenizer(t)["input_ids"]).mean(0), dim=0) for t in TEXTS])
    llm = _llm(tmp_path, pooler_config={"pooling_type": "MEAN", "normalize": True})
    _assert_cosine(_embeddings(llm, TEXTS), ref)
    # Per request: normalize off, dimensions (Matryoshka: truncated, then normalized again).
    raw = _embeddings(llm, TEXTS[:1], pooling_params=PoolingParams(normalize=False))[0]
    assert torch.allclose(F.normalize(raw, dim=0), ref[0], atol=1e-5)
    cut = _embeddings(llm, TEXTS[:1], pooling_params=PoolingParams(dimensions=16))[0]
    assert cut.shape == (16,) and torch.allclose(cut, F.normalize(raw[:16], dim=0), atol=1e-5)


def test_cross_encoder_scores_equal_sentence_transformers(tmp_path: Path) -> None:
    """BertForSequenceClassification (one label): LLM.score's pairs against CrossEncoder's
    sigmoid scores, and the token types it derives from [SEP] against the tokenizer's."""
    from sentence_transformers import CrossEncoder

    save_encoder(tmp_path, "BertForSequenceClassification", num_labels=1)
    ref = torch.tensor(CrossEncoder(str(tmp_path), device="cpu").predict(PAIRS))
    llm = _llm(tmp_path)
    ours = torch.tensor([o.outputs.score for o in llm.score(PAIRS[0][0], [b for _, b in PAIRS])])
    assert torch.allclose(ours, ref.float(), atol=SCORE_TOL), (ours, ref)
    # Pairwise lists give the same scores.
    pairwise = [o.outputs.score for o in llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS])]
    assert torch.allclose(torch.tensor(pairwise), ours, atol=1e-6)


@pytest.mark.parametrize(
    "architecture, num_labels",
    [
        ("XLMRobertaForSequenceClassification", 3),
        ("Qwen3ForSequenceClassification", 2),
        ("Qwen3ForSequenceClassification", 1),
        ("LlamaForSequenceClassification", 2),
        ("Qwen2ForSequenceClassification", 2),
    ],
)
def test_classifier_probabilities_equal_transformers(tmp_path: Path, architecture: str, num_labels: int) -> None:
    import transformers

    if not architecture.startswith(("Bert", "XLMRoberta")):
        save_decoder(tmp_path, architecture, num_labels=num_labels)
    else:
        save_encoder(tmp_path, architecture, num_labels=num_labels)
    model = getattr(transformers, architecture).from_pretrained(str(tmp_path)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    llm = _llm(tmp_path)
    outputs = llm.classify(TEXTS)
    for text, out in zip(TEXTS, outputs):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokenizer(text)["input_ids"]])).logits[0]
        ref = torch.sigmoid(logits) if num_labels == 1 else torch.softmax(logits, -1)
        assert torch.allclose(torch.tensor(out.outputs.probs), ref, atol=SCORE_TOL), (out.outputs.probs, ref)
    raw = llm.classify(TEXTS[:1], pooling_params=PoolingParams(activation=False))[0].outputs.probs
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokenizer(TEXTS[0])["input_ids"]])).logits[0]
    assert torch.allclose(torch.tensor(raw), logits, atol=SCORE_TOL)


@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_decoder_embedder_equals_sentence_transformers(tmp_path: Path, architecture: str) -> None:
    """A decoder with Qwen3-Embedding's files (lasttoken, Normalize), which sentence-transformers
    saves as the bare *Model: a pooling model of its own."""
    from sentence_transformers import SentenceTransformer

    save_decoder(tmp_path, architecture, pooling="lasttoken")
    st = SentenceTransformer(str(tmp_path), device="cpu")
    ref = st.encode(TEXTS, convert_to_tensor=True)
    llm = _llm(tmp_path)
    assert llm.llm_engine.model_config.runner == "pooling"
    _assert_cosine(_embeddings(llm, TEXTS), ref)
    with pytest.raises(ValueError, match="pooling model"):
        llm.generate("hello")


def test_causal_lm_as_embedder(tmp_path: Path) -> None:
    """A causal LM checkpoint under --runner pooling (no sentence-transformers files): its last
    token's final hidden state, normalized (transformers' hidden states)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    save_decoder(tmp_path, "Qwen3ForCausalLM")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    ref = torch.stack([F.normalize(hf_hidden(model, tokenizer(t)["input_ids"])[-1], dim=0) for t in TEXTS])
    llm = _llm(tmp_path, runner="pooling")
    _assert_cosine(_embeddings(llm, TEXTS), ref)
    with pytest.raises(ValueError, match="pooling model"):
        llm.generate("hello")


def test_errors_name_what_to_change(tmp_path: Path) -> None:
    save_encoder(tmp_path, "BertModel", "mean")
    llm = _llm(tmp_path, max_model_len=16)
    long_text = " ".join(["hello world"] * 20)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.embed([long_text])
    # Truncated, it runs: the first 15 tokens (the model's limit).
    out = llm.embed([long_text], truncate_prompt_tokens=-1)[0]
    assert len(out.prompt_token_ids) == 15
    with pytest.raises(ValueError, match="no classifier"):
        llm.classify(["hello"])
    with pytest.raises(ValueError, match="pooling model"):
        llm.generate("hello")


# vLLM's recipe for Qwen3-Reranker; the tiny tokenizer spells "no" and "yes" in several tokens,
# so its single-token "n" and "y" stand in for them.
RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["n", "y"],
            "is_original_qwen3_reranker": True}


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_reranker_from_its_causal_lm(tmp_path: Path, tied: bool) -> None:
    """A Qwen3ForCausalLM served with --hf-overrides' reranker recipe: a one-label classifier
    whose score is sigmoid(logit_yes - logit_no) of transformers' causal LM at the last token."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    save_decoder(tmp_path, "Qwen3ForCausalLM")
    if tied:  # no head in the checkpoint, the embedding's: the score row comes from embed_tokens
        from safetensors.torch import load_file, save_file

        weights = load_file(str(tmp_path / "model.safetensors"))
        del weights["lm_head.weight"]
        save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    no, yes = (tokenizer.encode(t, add_special_tokens=False)[0] for t in RERANKER["classifier_from_token"])
    llm = _llm(tmp_path, runner="pooling", hf_overrides=RERANKER)
    assert llm.llm_engine.model_config.num_labels == 1
    for text, out in zip(TEXTS, llm.classify(TEXTS)):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokenizer(text)["input_ids"]])).logits[0, -1]
        ref = torch.sigmoid(logits[yes] - logits[no])
        assert out.outputs.probs == pytest.approx([ref.item()], abs=SCORE_TOL)
    scores = [o.outputs.score for o in llm.score(PAIRS[0][0], [b for _, b in PAIRS])]
    for (a, b), score in zip(PAIRS, scores):
        ids = tokenizer(a, b)["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        assert score == pytest.approx(torch.sigmoid(logits[yes] - logits[no]).item(), abs=SCORE_TOL)


def test_hf_overrides_refuses_what_it_cannot_apply(tmp_path: Path) -> None:
    save_decoder(tmp_path, "Qwen3ForCausalLM")
    with pytest.raises(ValueError, match="rope_theta cannot be applied; supported: Qwen3-Reranker"):
        _llm(tmp_path, hf_overrides={"rope_theta": 5.0})
    with pytest.raises(ValueError, match="classifier_from_token 'no' is 2 tokens, not one"):
        _llm(tmp_path, hf_overrides={**RERANKER, "classifier_from_token": ["no", "yes"]})
    with pytest.raises(ValueError, match="the checkpoint is a Qwen3ForCausalLM; the conversion takes LlamaForCausalLM"):
        _llm(tmp_path, hf_overrides={**RERANKER, "architectures": ["LlamaForSequenceClassification"]})


@pytest.mark.slow  # llama.cpp's converter's own start
@pytest.mark.skipif(llama_cpp_dir() is None, reason="PAGEDLLM_LLAMA_CPP_DIR names no llama.cpp tree")
def test_qwen3_reranker_from_a_gguf_file(tmp_path: Path) -> None:
    """The recipe on a `qwen3` GGUF (Q8_0, as llama.cpp's converter writes it): the score row
    comes from the kept head's two rows, dequantized; against transformers' causal LM reading
    the same file (1e-3: the kept kernels' activation rounding, as test_gpt2_gguf). head_dim
    128: transformers' GGUF reader leaves Qwen3's at its default."""
    import transformers

    from tests.models.pooling_utils import randomize
    from tests.models.utils import TINY_BOS_ID, TINY_EOS_ID, save_tiny_tokenizer

    src = tmp_path / "src"
    src.mkdir()
    tokenizer = save_tiny_tokenizer(src)
    config = transformers.Qwen3Config(
        vocab_size=262, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=128, max_position_embeddings=256, bos_token_id=TINY_BOS_ID,
        eos_token_id=TINY_EOS_ID, tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"],
    )  # fmt: skip
    model = transformers.Qwen3ForCausalLM(config).eval()
    randomize(model, std=0.05)
    model.save_pretrained(str(src))
    path = tmp_path / "reranker-q8_0.gguf"
    convert_with_llama_cpp(src, path, "q8_0")
    no, yes = (tokenizer.encode(t, add_special_tokens=False)[0] for t in RERANKER["classifier_from_token"])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    llm = _llm(path, runner="pooling", hf_overrides=RERANKER)
    for out in llm.classify(TEXTS):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([out.prompt_token_ids])).logits[0, -1]
        assert out.outputs.probs == pytest.approx([torch.sigmoid(logits[yes] - logits[no]).item()], abs=1e-3)
