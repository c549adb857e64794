"""Tiny random pooling checkpoints for the pooling tests: BERT / XLM-RoBERTa encoders and
their cross-encoders with a WordPiece tokenizer, decoders (Qwen3) as embedders and
classifiers with the tiny BPE tokenizer; sentence-transformers' own files written by
sentence-transformers (its `save`), so the pooling read from them is its format."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tests.models.utils import TINY_BOS_ID, TINY_EOS_ID, save_tiny_tokenizer

WORDS = [
    "the", "cat", "dog", "sat", "on", "mat", "is", "hello", "world", "paris", "capital", "of",
    "france", "what", "where", "sun", "hot", "cold", "##s", "##ing", "##ed",
]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TEXTS = [
    "the cat sat on the mat",
    "hello world",
    "what is the capital of france? paris is the capital of france, where the sun is hot",
    "a dog",
    "cold",
]


def save_wordpiece_tokenizer(path: str | os.PathLike[str]) -> Any:
    """BERT's WordPiece tokenizer over a small vocabulary (letters, a few words; no word twice,
    so every id up to its size names a token, as llama.cpp's converter checks)."""
    from transformers import BertTokenizerFast

    vocab = SPECIAL + list("abcdefghijklmnopqrstuvwxyz?,.") + WORDS
    vocab_file = Path(path) / "vocab.txt"
    vocab_file.write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(str(vocab_file))
    tokenizer.save_pretrained(str(path))
    return tokenizer


def randomize(model: torch.nn.Module, std: float = 0.2, seed: int = 0) -> None:
    """Every matrix and bias N(0, std), norm scales 1 +- 0.1: zero biases and unit norms
    would hide layout mistakes."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ("LayerNorm" in name or "norm" in name) and name.endswith("weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(std * torch.randn_like(param))


def bert_config(kind: str = "bert", num_labels: int = 1, vocab_size: int = 64) -> Any:
    from transformers import BertConfig, XLMRobertaConfig

    common = dict(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, num_labels=num_labels,
    )
    if kind == "xlm-roberta":
        return XLMRobertaConfig(**common, pad_token_id=0, type_vocab_size=1)
    return BertConfig(**common, pad_token_id=0, type_vocab_size=2)


def save_encoder(path: Path, architecture: str, pooling: str | None = "mean", normalize: bool = True,
                 num_labels: int = 1) -> Any:
    """An encoder checkpoint at ``path``: BertModel / XLMRobertaModel (with sentence-
    transformers' modules when ``pooling`` is given) or a *ForSequenceClassification."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = save_wordpiece_tokenizer(path)
    kind = "xlm-roberta" if architecture.startswith("XLMRoberta") else "bert"
    config = bert_config(kind, num_labels, vocab_size=len(tokenizer))
    model = getattr(transformers, architecture)(config).eval()
    randomize(model)
    model.save_pretrained(str(path))
    if pooling is not None and not architecture.endswith("ForSequenceClassification"):
        save_sentence_transformers(path, config.hidden_size, pooling, normalize)
    return model


def save_sentence_transformers(path: Path, dimension: int, pooling: str, normalize: bool) -> None:
    """sentence-transformers' own modules.json and 1_Pooling (2_Normalize) beside the weights."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    modules = [Transformer(str(path)), Pooling(dimension, pooling)] + ([Normalize()] if normalize else [])
    SentenceTransformer(modules=modules, device="cpu").save(str(path))


def decoder_config(architecture: str = "Qwen3ForCausalLM", num_labels: int = 1) -> Any:
    """A Llama, Qwen2 or Qwen3 config (by the architecture's prefix)."""
    import transformers

    config_class = getattr(transformers, architecture.split("For")[0].removesuffix("Model") + "Config")
    return config_class(
        vocab_size=262, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID, pad_token_id=TINY_EOS_ID,
        num_labels=num_labels, architectures=[architecture],
    )  # fmt: skip


def save_decoder(path: Path, architecture: str = "Qwen3ForCausalLM", pooling: str | None = None,
                 normalize: bool = True, num_labels: int = 1) -> Any:
    """A decoder checkpoint (causal LM or sequence classifier) with the tiny tokenizer; with
    ``pooling``, sentence-transformers' files as Qwen3-Embedding ships them (lasttoken; saved
    by sentence-transformers, the checkpoint becomes the bare `*Model`)."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = save_tiny_tokenizer(path)
    tokenizer.pad_token = tokenizer.eos_token  # sentence-transformers pads its batches
    # sentence-transformers 6 renders texts through a chat template when the tokenizer has
    # one; an embedder's inputs are the raw texts.
    tokenizer.chat_template = None
    (path / "chat_template.jinja").unlink()
    tokenizer.save_pretrained(str(path))
    model = getattr(transformers, architecture)(decoder_config(architecture, num_labels)).eval()
    randomize(model)
    model.save_pretrained(str(path))
    if pooling is not None:
        save_sentence_transformers(path, 64, pooling, normalize)
    return model


def hf_hidden(model: Any, ids: list[int], token_types: list[int] | None = None) -> torch.Tensor:
    """transformers' last hidden states of one prompt: [T, H]."""
    kwargs = {} if token_types is None else {"token_type_ids": torch.tensor([token_types])}
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, **kwargs)
    return out.hidden_states[-1][0] if hasattr(out, "hidden_states") and out.hidden_states else out.last_hidden_state[0]
