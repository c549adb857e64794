"""BERT and XLM-RoBERTa encoders over a flat batch of prompts: bidirectional attention, learned
positions, post-norm LayerNorm blocks, GELU; pooling models only (models/pooling.py).

Each prompt must run whole in one step (bidirectional attention: attention/params.py `causal`).
Token types come from the prompt itself: a token after its prompt's first separator is segment
1 (a cross-encoder's pair "[CLS] a [SEP] b [SEP]" as its tokenizer builds it), so the model
still sees only (input_ids, positions); the engine sets `sep_token_id` from the tokenizer.
XLM-RoBERTa reads position p at row p + padding_idx + 1 (fairseq's convention) and has one
token type. Parameter names are HF's, except query/key/value, which load into `qkv_proj`.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

import torch
from torch import nn

from pagedllm.layers.activation import get_act_fn
from pagedllm.layers.attention import Attention
from pagedllm.layers.embedding import LearnedPositionEmbedding, VocabEmbedding
from pagedllm.layers.linear import Linear, QKVLinear
from pagedllm.layers.norm import LayerNorm
from pagedllm.layers.utils import default_dtype
from pagedllm.models.family import ArchConfig, GGUFSpec, ModelFamily
from pagedllm.models.pooling import PoolerConfig
from pagedllm.models.utils import load_named_weights

PACKED_MODULES = (
    ("qkv_proj", "query", "q"),
    ("qkv_proj", "key", "k"),
    ("qkv_proj", "value", "v"),
)


def token_type_ids(input_ids: torch.Tensor, positions: torch.Tensor, sep_token_id: int | None) -> torch.Tensor:
    """[T] each token's segment: 1 after the first separator of its prompt, else 0 (each
    prompt starts at position 0)."""
    if sep_token_id is None:
        return torch.zeros_like(input_ids)
    is_sep = (input_ids == sep_token_id).to(torch.int64)
    seen = torch.cumsum(is_sep, 0) - is_sep  # [T] separators strictly before each token
    prompt = torch.cumsum((positions == 0).to(torch.int64), 0) - 1  # [T] prompt index
    first = torch.nonzero(positions == 0).flatten()  # [R] each prompt's first row
    return (seen - seen[first][prompt]).clamp(max=1)


class BertEmbeddings(nn.Module):
    def __init__(self, hf: Any, position_offset: int) -> None:
        super().__init__()
        self.word_embeddings = VocabEmbedding(hf.vocab_size, hf.hidden_size)
        self.position_embeddings = LearnedPositionEmbedding(
            hf.max_position_embeddings - position_offset, hf.hidden_size, offset=position_offset
        )
        self.token_type_embeddings = LearnedPositionEmbedding(hf.type_vocab_size, hf.hidden_size)
        self.LayerNorm = LayerNorm(hf.hidden_size, eps=hf.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        # input_ids, positions, token_types: [T] -> [T, hidden]
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings(token_types))


class BertSelfAttention(nn.Module):
    def __init__(self, hf: Any) -> None:
        super().__init__()
        heads = hf.num_attention_heads
        head_dim = hf.hidden_size // heads
        self.qkv_proj = QKVLinear(hf.hidden_size, head_dim, heads, heads, bias=True)
        self.attn = Attention(heads, head_dim, heads, scale=head_dim**-0.5, causal=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        return self.attn(q, k, v)


class BertOutput(nn.Module):
    """dense, then LayerNorm(x + residual): the block's two post-norm sublayer ends."""

    def __init__(self, in_features: int, hf: Any) -> None:
        super().__init__()
        self.dense = Linear(in_features, hf.hidden_size, bias=True)
        self.LayerNorm = LayerNorm(hf.hidden_size, eps=hf.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, hf: Any) -> None:
        super().__init__()
        self.self = BertSelfAttention(hf)
        self.output = BertOutput(hf.hidden_size, hf)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(hidden_states), hidden_states)


class BertIntermediate(nn.Module):
    def __init__(self, hf: Any) -> None:
        super().__init__()
        self.dense = Linear(hf.hidden_size, hf.intermediate_size, bias=True)
        self.act = get_act_fn(hf.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, hf: Any) -> None:
        super().__init__()
        self.attention = BertAttention(hf)
        self.intermediate = BertIntermediate(hf)
        self.output = BertOutput(hf.intermediate_size, hf)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.attention(hidden_states)
        return self.output(self.intermediate(hidden_states), hidden_states)


class BertEncoder(nn.Module):
    def __init__(self, hf: Any) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(hf) for _ in range(hf.num_hidden_layers))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            hidden_states = layer(hidden_states)
        return hidden_states


class BertPooler(nn.Module):
    """tanh(dense(h_CLS)): BertForSequenceClassification's input to its classifier."""

    def __init__(self, hf: Any) -> None:
        super().__init__()
        self.dense = Linear(hf.hidden_size, hf.hidden_size, bias=True)

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_hidden))


class BertModel(nn.Module):
    """The encoder: forward -> every token's last hidden state [T, hidden]."""

    pooler_defaults = PoolerConfig("CLS", False)
    position_offset = 0
    """Rows of the position table before position 0's (XLM-RoBERTa: padding_idx + 1)."""
    weight_prefix = "bert."
    """The encoder's prefix in the classification checkpoints (dropped at load)."""

    def __init__(self, arch: ArchConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        hf = self.config = arch.hf
        self.arch = arch
        self.sep_token_id: int | None = None
        offset = self.position_offset_of(hf)
        with default_dtype(dtype):
            self.embeddings = BertEmbeddings(hf, offset)
            self.encoder = BertEncoder(hf)
            self._build_head(hf)

    @staticmethod
    def position_offset_of(hf: Any) -> int:
        return 0

    def _build_head(self, hf: Any) -> None:
        """The layers after the encoder (none: the checkpoint's pooler is not used to embed)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] int64 -> [T, hidden]
        types = token_type_ids(input_ids, positions, self.sep_token_id if self.config.type_vocab_size > 1 else None)
        return self.encoder(self.embeddings(input_ids, positions, types))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def transform(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
            if name.startswith(self.weight_prefix):
                name = name[len(self.weight_prefix):]
            if name.endswith("position_ids") or name.endswith("token_type_ids"):
                return None  # buffers, not weights
            if name.startswith("pooler.") and not hasattr(self, "pooler"):
                return None
            return name, tensor

        return load_named_weights(self, weights, stacked=PACKED_MODULES, transform=transform)


class BertForSequenceClassification(BertModel):
    """A cross-encoder: classify(h_CLS) = classifier(tanh(pooler(h_CLS))) -> [R, num_labels]."""

    def _build_head(self, hf: Any) -> None:
        self.pooler = BertPooler(hf)
        self.classifier = Linear(hf.hidden_size, hf.num_labels, bias=True)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        # pooled: [R, hidden] (each prompt's CLS state) -> [R, num_labels] float32
        return self.classifier(self.pooler(pooled)).float()


class XLMRobertaModel(BertModel):
    weight_prefix = "roberta."

    @staticmethod
    def position_offset_of(hf: Any) -> int:
        return hf.pad_token_id + 1


class XLMRobertaClassificationHead(nn.Module):
    """out_proj(tanh(dense(h_CLS)))."""

    def __init__(self, hf: Any) -> None:
        super().__init__()
        self.dense = Linear(hf.hidden_size, hf.hidden_size, bias=True)
        self.out_proj = Linear(hf.hidden_size, hf.num_labels, bias=True)

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(cls_hidden)))


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    def _build_head(self, hf: Any) -> None:
        self.classifier = XLMRobertaClassificationHead(hf)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        # pooled: [R, hidden] -> [R, num_labels] float32
        return self.classifier(pooled).float()


def _bert_arch_config(hf: Any) -> ArchConfig:
    return ArchConfig(
        hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_attention_heads,
        head_dim=hf.hidden_size // hf.num_attention_heads,
        intermediate_size=hf.intermediate_size,
        vocab_size=hf.vocab_size,
        max_position_embeddings=hf.max_position_embeddings - XLMRobertaModel.position_offset_of(hf)
        if hf.model_type == "xlm-roberta" else hf.max_position_embeddings,
        norm_eps=hf.layer_norm_eps,
        norm="layer",
        norm_placement="post",
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        activation=hf.hidden_act,
        gated_mlp=False,
        rope=None,  # learned positions
        hf=hf,
    )


# llama.cpp's `bert` files (convert_hf_to_gguf.py's BertModel): tensor names -> HF's.
_BERT_GGUF_GLOBAL_NAMES = {
    "token_embd": "embeddings.word_embeddings",
    "position_embd": "embeddings.position_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "token_embd_norm": "embeddings.LayerNorm",
}
_BERT_GGUF_BLOCK_NAMES = {
    "attn_q": "attention.self.query",
    "attn_k": "attention.self.key",
    "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense",
    "layer_output_norm": "output.LayerNorm",
}
# llama.cpp's enum llama_pooling_type (the file's `bert.pooling_type`) -> sentence-transformers'
# pooling modes; 0 (none: per-token outputs) and 4 (rank: a classifier head) are not served.
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "lasttoken"}
_GGUF_POOLING_NAMES = {0: "none", 4: "rank"}
_CONTROL_TOKEN = 3  # gguf.TokenType.CONTROL


def _bert_metadata_from_gguf(reader: Any, out_dir: str) -> tuple[Any, Any]:
    """A `bert` GGUF's BertConfig and WordPiece tokenizer (transformers' GGUF reader has
    neither), and its pooling as sentence-transformers' modules in `out_dir`."""
    from transformers import BertConfig, BertTokenizerFast

    def value(key: str, default: Any = None) -> Any:
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    tokens = [str(t) for t in value("tokenizer.ggml.tokens", [])]
    types = [int(t) for t in value("tokenizer.ggml.token_type", [_CONTROL_TOKEN] * len(tokens))]
    if value("tokenizer.ggml.model") != "bert" or not tokens:
        raise ValueError(f"tokenizer {value('tokenizer.ggml.model')!r} is not supported; supported: bert (WordPiece)")
    # The converter wrote word starts as "\u2581word" and continuations bare; WordPiece spells
    # them "word" and "##piece" (control tokens unchanged).
    vocab = [t if kind == _CONTROL_TOKEN else t[1:] if t.startswith("\u2581") else "##" + t
             for t, kind in zip(tokens, types)]
    vocab_file = os.path.join(out_dir, "vocab.txt")
    with open(vocab_file, "w", encoding="utf-8") as f:
        f.write("\n".join(vocab) + "\n")
    # The converter's keys: CLS is the BOS, SEP the separator (and the EOS).
    keys = {"unk": ("unknown",), "sep": ("seperator", "eos"), "pad": ("padding",), "cls": ("bos",), "mask": ("mask",)}
    special = {}
    for name, spellings in keys.items():
        token_id = next((v for k in spellings if (v := value(f"tokenizer.ggml.{k}_token_id")) is not None), None)
        if token_id is not None and 0 <= int(token_id) < len(vocab):
            special[f"{name}_token"] = vocab[int(token_id)]
    # llama.cpp's WordPiece lowercases and strips accents, as BERT's uncased tokenizer does.
    tokenizer = BertTokenizerFast(vocab_file, do_lower_case=True, **special)
    os.remove(vocab_file)  # saved again with the tokenizer
    pad = value("tokenizer.ggml.padding_token_id")
    config = BertConfig(
        vocab_size=len(tokens),
        hidden_size=int(value("bert.embedding_length")),
        num_hidden_layers=int(value("bert.block_count")),
        num_attention_heads=int(value("bert.attention.head_count")),
        intermediate_size=int(value("bert.feed_forward_length")),
        max_position_embeddings=int(value("bert.context_length")),
        layer_norm_eps=float(value("bert.attention.layer_norm_epsilon", 1e-12)),
        type_vocab_size=int(value("bert.token_type_count", value("tokenizer.ggml.token_type_count", 2))),
        pad_token_id=int(pad) if pad is not None else 0,
        hidden_act="gelu",
        architectures=["BertModel"],
    )
    pooling_type = value("bert.pooling_type")
    if pooling_type is not None:
        mode = _GGUF_POOLING.get(int(pooling_type))
        if mode is None:
            name = _GGUF_POOLING_NAMES.get(int(pooling_type), str(pooling_type))
            raise ValueError(f"bert.pooling_type {pooling_type} ({name}) is not supported; supported: 1 (mean), 2 (cls), 3 (last)")
        _write_pooling_modules(out_dir, config.hidden_size, mode)
    return config, tokenizer


def _write_pooling_modules(out_dir: str, dimension: int, mode: str) -> None:
    """sentence-transformers' modules.json, 1_Pooling/config.json and 2_Normalize: the file's
    pooling, normalized as llama.cpp's server does by default (--embd-normalize 2)."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    with open(os.path.join(out_dir, "modules.json"), "w") as f:
        json.dump(modules, f, indent=2)
    os.makedirs(os.path.join(out_dir, "1_Pooling"))
    os.makedirs(os.path.join(out_dir, "2_Normalize"))
    with open(os.path.join(out_dir, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": dimension, "pooling_mode": mode}, f, indent=2)


FAMILIES = (
    ModelFamily(
        "BERT", ("BertModel",), BertModel, _bert_arch_config, PACKED_MODULES, runner="pooling",
        gguf=GGUFSpec(
            "bert",
            _BERT_GGUF_BLOCK_NAMES,
            global_names=_BERT_GGUF_GLOBAL_NAMES,
            block_prefix="encoder.layer",
            metadata_from_gguf=_bert_metadata_from_gguf,
        ),
    ),
    ModelFamily(
        "BERT cross-encoder", ("BertForSequenceClassification",), BertForSequenceClassification,
        _bert_arch_config, PACKED_MODULES, runner="pooling",
    ),
    ModelFamily("XLM-RoBERTa", ("XLMRobertaModel",), XLMRobertaModel, _bert_arch_config, PACKED_MODULES, runner="pooling"),
    ModelFamily(
        "XLM-RoBERTa cross-encoder", ("XLMRobertaForSequenceClassification",), XLMRobertaForSequenceClassification,
        _bert_arch_config, PACKED_MODULES, runner="pooling",
    ),
)
