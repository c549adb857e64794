"""BERT GGUF files (llama.cpp's `bert` architecture; models/bert.py's GGUFSpec): config, WordPiece
tokenizer and pooling rebuilt from the file's metadata (`bert.pooling_type`, llama.cpp's enum),
the weights read by the GGUF loader; embeddings against sentence-transformers on the source
checkpoint (cosine > 0.9999 in float32). The file is written with gguf-py's writer as llama.cpp's
converter writes it (runs everywhere) and, where PAGEDLLM_LLAMA_CPP_DIR names a tree, by the
converter itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM
from tests.models.pooling_utils import TEXTS, save_encoder
from tests.models.utils import convert_with_llama_cpp, llama_cpp_dir

COSINE = 0.9999
# llama.cpp's converter: HF name (after dropping "bert.") -> GGUF name.
_GLOBAL = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.position_embeddings": "position_embd",
    "embeddings.token_type_embeddings": "token_types",
    "embeddings.LayerNorm": "token_embd_norm",
}
_BLOCK = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}
_POOLING = {"mean": 1, "cls": 2}


def _gguf_name(hf_name: str) -> str | None:
    base, _, kind = hf_name.rpartition(".")
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{kind}"
    if base.startswith("encoder.layer."):
        block, _, rest = base[len("encoder.layer."):].partition(".")
        return f"blk.{block}.{_BLOCK[rest]}.{kind}"
    return None  # the pooler and position_ids: not written


def write_bert_gguf(src: Path, path: Path, pooling_type: int | None) -> None:
    """The HF BertModel at `src` as llama.cpp's BertModel converter writes it (F32): its
    hyperparameters, the WordPiece vocabulary in "phantom space" form (word starts prefixed
    with U+2581, continuations without their ##), the special token ids, the pooling type."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(src))
    tokenizer = AutoTokenizer.from_pretrained(str(src))
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_layer_norm_eps(config.layer_norm_eps)
    writer.add_causal_attention(False)
    if pooling_type is not None:
        writer.add_pooling_type(gguf.PoolingType(pooling_type))
    writer.add_token_type_count(config.type_vocab_size)
    special = set(tokenizer.all_special_tokens)
    tokens, types = [], []
    for token in tokenizer.convert_ids_to_tokens(list(range(config.vocab_size))):
        if token in special:
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL)
        else:
            tokens.append(token[2:] if token.startswith("##") else "\u2581" + token)
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("bert")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # gguf-py's special vocabulary: CLS as the BOS, SEP as the EOS and the separator.
    writer.add_bos_token_id(tokenizer.cls_token_id)
    writer.add_eos_token_id(tokenizer.sep_token_id)
    for name in ("unk", "sep", "pad", "mask"):
        getattr(writer, f"add_{name}_token_id")(getattr(tokenizer, f"{name}_token_id"))
    for hf_name, tensor in load_file(str(src / "model.safetensors")).items():
        name = _gguf_name(hf_name.removeprefix("bert."))
        if name is not None:
            writer.add_tensor(name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _reference(src: Path) -> tuple[Any, torch.Tensor]:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(src), device="cpu")
    return st.tokenizer, st.encode(TEXTS, convert_to_tensor=True)


def _check(path: Path, src: Path, bound: float = COSINE) -> None:
    tokenizer, ref = _reference(src)
    llm = LLM(str(path), dtype="float32", matmul_activations="float32", kv_cache_memory_bytes="8MiB")
    outputs = llm.embed(TEXTS)
    # The tokenizer rebuilt from the file's vocabulary splits each text as the source's did.
    assert [o.prompt_token_ids for o in outputs] == [tokenizer(t)["input_ids"] for t in TEXTS]
    ours = torch.tensor([o.outputs.embedding for o in outputs])
    cosine = F.cosine_similarity(ours, ref.float(), dim=-1)
    assert bool((cosine > bound).all()), cosine
    norms = ours.norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-5), norms


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_bert_gguf_embeddings_equal_sentence_transformers(tmp_path: Path, pooling: str) -> None:
    src = tmp_path / "src"
    save_encoder(src, "BertModel", pooling, normalize=True)
    path = tmp_path / "tiny-bert.gguf"
    write_bert_gguf(src, path, _POOLING[pooling])
    _check(path, src)


def test_bert_gguf_without_a_pooling_type_pools_as_the_family(tmp_path: Path) -> None:
    """No `bert.pooling_type` (the converter writes it only from sentence-transformers' files):
    BERT's default, the CLS state unnormalized, as the same checkpoint loads from safetensors."""
    from transformers import AutoTokenizer, BertModel

    from tests.models.pooling_utils import hf_hidden

    src = tmp_path / "src"
    save_encoder(src, "BertModel", pooling=None)
    path = tmp_path / "plain.gguf"
    write_bert_gguf(src, path, None)
    model = BertModel.from_pretrained(str(src)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(src))
    ref = torch.stack([hf_hidden(model, tokenizer(t)["input_ids"])[0] for t in TEXTS])
    llm = LLM(str(path), dtype="float32", matmul_activations="float32", kv_cache_memory_bytes="8MiB")
    assert llm.llm_engine.model_config.pooler.pooling_type == "CLS" and not llm.llm_engine.model_config.pooler.normalize
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS)])
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_bert_gguf_pooling_types_refused(tmp_path: Path) -> None:
    """Per-token (0, none) and rank (4) pooling are not served: a one-line error naming the key."""
    src = tmp_path / "src"
    save_encoder(src, "BertModel", "mean")
    path = tmp_path / "rank.gguf"
    write_bert_gguf(src, path, 4)
    with pytest.raises(ValueError, match=r"bert.pooling_type 4 \(rank\) is not supported"):
        LLM(str(path), dtype="float32", kv_cache_memory_bytes="8MiB")


@pytest.mark.slow  # the converter's own start (torch, transformers)
@pytest.mark.skipif(llama_cpp_dir() is None, reason="PAGEDLLM_LLAMA_CPP_DIR names no llama.cpp tree")
@pytest.mark.parametrize("outtype, bound", [("f32", COSINE), ("f16", COSINE), ("q8_0", 0.999)])
def test_bert_written_by_llama_cpp_converter(tmp_path: Path, outtype: str, bound: float) -> None:
    """The converter's files in its float and Q8_0 types (matrices kept as the file's blocks);
    Q8_0's rounding moves the vectors by about 1e-4 in cosine (measured 0.9999)."""
    src = tmp_path / "src"
    save_encoder(src, "BertModel", "mean", normalize=True)
    path = tmp_path / "gguf" / f"tiny-bert-{outtype}.gguf"
    path.parent.mkdir()
    convert_with_llama_cpp(src, path, outtype)
    _check(path, src, bound)
