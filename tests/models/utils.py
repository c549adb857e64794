"""Helpers to run a model outside the engine: bind KV caches, build attention metadata,
and drive one or more requests through prefill and decode steps; plus tiny checkpoints.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from pagedllm.attention.layouts import BLOCK_TABLES
from pagedllm.attention.metadata import AttentionMetadata, forward_context
from pagedllm.attention.registry import bind_default_backend
from pagedllm.layers.attention import Attention


def bind_kv_caches(
    model: nn.Module, num_blocks: int = 64, block_size: int = 16, dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """Allocate a zeroed KV cache per Attention layer and bind it; returns the caches."""
    caches = []
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for module in layers:
        cache_dtype = dtype or next(model.parameters()).dtype
        shape = (2, num_blocks, block_size, module.num_kv_heads, module.head_dim)
        module.kv_cache = torch.zeros(shape, dtype=cache_dtype)
        caches.append(module.kv_cache)
    bind_default_backend(layers, BLOCK_TABLES, "cpu")  # layers bound to a backend keep it
    return caches


@contextlib.contextmanager
def kv_caches_bound(
    model: nn.Module, num_blocks: int = 64, block_size: int = 16
) -> Iterator[list[torch.Tensor]]:
    """bind_kv_caches for a with-block, restoring the previous bindings after it (for models
    shared between tests, such as the session's default model)."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    previous = [layer.kv_cache for layer in layers]
    try:
        yield bind_kv_caches(model, num_blocks, block_size)
    finally:
        for layer, cache in zip(layers, previous):
            layer.kv_cache = cache


@dataclass
class RequestState:
    """One sequence's tokens and its blocks (block 0 is the reserved null block)."""

    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int = 0
    logprobs: list[torch.Tensor] = field(default_factory=list)


def make_metadata(
    chunks: list[tuple[RequestState, int]], block_size: int
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """Metadata, input_ids and positions for one step: (request, num_new_tokens) per request.

    Decodes (num_new_tokens == 1) must come first, as the runner orders them.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    query_start_loc = [0]
    num_decodes = 0
    for req, num_new in chunks:
        start = req.num_computed_tokens
        end = start + num_new
        assert end <= len(req.block_ids) * block_size, "request needs more blocks"
        if num_new == 1 and num_decodes == len(seq_lens):
            num_decodes += 1
        for pos in range(start, end):
            input_ids.append(req.token_ids[pos])
            positions.append(pos)
            slots.append(req.block_ids[pos // block_size] * block_size + pos % block_size)
        seq_lens.append(end)
        query_start_loc.append(query_start_loc[-1] + num_new)
    max_blocks = max(len(req.block_ids) for req, _ in chunks)
    block_tables = torch.zeros(len(chunks), max_blocks, dtype=torch.int64)
    for i, (req, _) in enumerate(chunks):
        block_tables[i, : len(req.block_ids)] = torch.tensor(req.block_ids)
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        query_start_loc=query_start_loc,
        seq_lens_list=seq_lens,
        num_decodes=num_decodes,
        block_size=block_size,
    )
    input_ids_t = torch.tensor(input_ids, dtype=torch.int64)
    return md, input_ids_t, torch.tensor(positions, dtype=torch.int64)


@torch.inference_mode()
def step(model: Any, chunks: list[tuple[RequestState, int]], block_size: int) -> None:
    """Run one forward over the chunks; append each request's last-token logprobs and
    advance num_computed_tokens."""
    md, input_ids, positions = make_metadata(chunks, block_size)
    with forward_context(md):
        hidden = model(input_ids, positions)  # [T, hidden]
    last = torch.tensor(md.query_start_loc[1:]) - 1
    logprobs = model.compute_logits(hidden[last]).log_softmax(-1)  # [num_reqs, vocab]
    for i, (req, num_new) in enumerate(chunks):
        req.num_computed_tokens += num_new
        req.logprobs.append(logprobs[i])


@torch.inference_mode()
def prompt_logprobs(model: Any, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Log-probabilities after every token of one sequence, processed in a single pass."""
    req = RequestState(list(token_ids), allocate_blocks(len(token_ids), block_size))
    md, input_ids, positions = make_metadata([(req, len(token_ids))], block_size)
    with forward_context(md):
        hidden = model(input_ids, positions)
    return model.compute_logits(hidden).log_softmax(-1)  # [T, vocab]


def allocate_blocks(num_tokens: int, block_size: int, first_block: int = 1) -> list[int]:
    """Consecutive block ids [first_block, ...] covering num_tokens (block 0 stays null)."""
    num_blocks = (num_tokens + block_size - 1) // block_size
    return list(range(first_block, first_block + num_blocks))


def greedy_generate(
    model: Any,
    prompt_ids: list[int],
    max_new_tokens: int,
    block_size: int = 16,
    prefill_chunk: int | None = None,
) -> RequestState:
    """Prefill (in chunks of prefill_chunk tokens, default all at once), then greedy decode.

    req.logprobs[i] is the distribution from which output token i was chosen.
    """
    total = len(prompt_ids) + max_new_tokens
    req = RequestState(list(prompt_ids), allocate_blocks(total, block_size))
    chunk = prefill_chunk or len(prompt_ids)
    while req.num_computed_tokens < len(prompt_ids):
        step(model, [(req, min(chunk, len(prompt_ids) - req.num_computed_tokens))], block_size)
    req.logprobs = req.logprobs[-1:]
    for i in range(max_new_tokens):
        req.token_ids.append(int(req.logprobs[-1].argmax()))
        if i + 1 < max_new_tokens:
            step(model, [(req, 1)], block_size)
    return req


# The tiny tokenizer: 256 byte tokens, 3 merges, then <s>, </s>, <|im_end|>.
TINY_MERGES = [("Ġ", "t"), ("h", "e"), ("t", "h")]
TINY_BOS_ID, TINY_EOS_ID, TINY_IM_END_ID = 259, 260, 261


def save_tiny_tokenizer(path: str | os.PathLike[str]) -> Any:
    """A byte-level BPE tokenizer (ids above) with a ChatML-like template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["".join(m) for m in TINY_MERGES]
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=TINY_MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    assert (fast.bos_token_id, fast.eos_token_id) == (TINY_BOS_ID, TINY_EOS_ID)
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
    )
    fast.save_pretrained(str(path))
    return fast


def save_tiny_model(
    path: str | os.PathLike[str], hf_config: Any, seed: int = 0, max_shard_size: str | None = None
) -> Any:
    """Random-weight HF model (float32, eval) saved as safetensors with a tiny tokenizer.

    Weights are drawn wider than HF's init (std 0.1, norms 1 +- 0.1) so the comparison
    with our model is sensitive to layout mistakes.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.1 * torch.randn_like(param))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    save_tiny_tokenizer(path)
    return model


def gguf_tensor_name(hf_name: str, arch: str = "llama") -> str:
    """The llama.cpp name of an HF tensor, by the family's declared GGUF names (inverted)."""
    from pagedllm.models.gguf_loader import gguf_spec

    spec = gguf_spec(arch)
    base, _, kind = hf_name.rpartition(".")
    top = {hf: gguf for gguf, hf in spec.global_names.items()}
    if base in top:
        return f"{top[base]}.{kind}"
    layer, _, part = base.removeprefix(f"{spec.block_prefix}.").partition(".")
    block = {hf: gguf for gguf, hf in {**spec.block_names, **spec.optional_block_names}.items()}
    return f"blk.{layer}.{block[part]}.{kind}"


def _llama_cpp_permute(w: Any, num_heads: int) -> Any:
    # As llama.cpp's converter: each head's halves interleaved row by row.
    rest = w.shape[1:]
    w4 = w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *rest)
    return w4.swapaxes(1, 2).reshape(w.shape)


def add_tiny_vocab(writer: Any, tokenizer: Any, vocab_size: int) -> None:
    """The tiny (byte-level BPE) tokenizer as llama.cpp's `gpt2` tokenizer metadata, padded
    to `vocab_size` with unused tokens."""
    import gguf

    tokens = [f"<unused{i}>" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for token, token_id in tokenizer.get_vocab().items():
        tokens[token_id] = token
        special = token in tokenizer.added_tokens_encoder
        types[token_id] = gguf.TokenType.CONTROL if special else gguf.TokenType.NORMAL
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(m) for m in TINY_MERGES])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)



def add_decoder_shape(writer: Any, cfg: Any) -> None:
    """A decoder's shape keys as llama.cpp's converter writes them (layers, context, widths, heads)."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)

def save_tiny_gguf(
    path: str | os.PathLike[str],
    hf_model: Any,
    tokenizer: Any,
    qtype: str = "Q8_0",
    arch: str = "llama",
    extra: Callable[[Any], None] | None = None,
    type_of: Callable[[str], str] | None = None,
    split_max_tensors: int = 0,
) -> None:
    """Write a Llama-shaped HF model and its (byte-level BPE) tokenizer as a llama.cpp-style
    GGUF of the GGUF architecture `arch`, with that family's declared tensor names, Q/K
    permutation and (1 + w) norms (models/family.py's GGUFSpec), and the keys llama.cpp's
    converter writes for what the config has (head_dim, sliding window, soft-caps: Gemma).

    2-D projection weights are quantized to `qtype`, the embedding to Q8_0, norms stay F32;
    `type_of(hf_name)`, if given, chooses each matrix's type instead. A type gguf-py cannot
    quantize gets random valid blocks (`random_blocks`) in place of the model's weights.
    `extra(writer)` adds the family's own metadata and tensors (e.g. Phi-3's long rope).
    """
    import gguf
    import numpy as np

    from pagedllm.models.gguf_loader import gguf_spec

    spec = gguf_spec(arch)
    cfg = hf_model.config
    # split_max_tensors > 0: llama.cpp's split files, <stem>-0000i-of-0000n.gguf beside `path`.
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    writer.add_name(f"tiny-{arch}")
    add_decoder_shape(writer, cfg)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(float(rope.get("rope_theta") or rope["full_attention"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "head_dim", None):
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    if getattr(cfg, "attn_logit_softcapping", None):
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    if getattr(cfg, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    add_tiny_vocab(writer, tokenizer, cfg.vocab_size)
    if extra is not None:
        extra(writer)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.float().numpy()
        if spec.permuted_qk and ".q_proj." in name:
            w = _llama_cpp_permute(w, cfg.num_attention_heads)
        elif spec.permuted_qk and ".k_proj." in name:
            w = _llama_cpp_permute(w, cfg.num_key_value_heads)
        elif spec.norm_plus_one and name.endswith("norm.weight"):
            w = w + 1.0  # llama.cpp stores Gemma's scales as (1 + weight)
        gguf_name = gguf_tensor_name(name, arch)
        if w.ndim == 1:
            writer.add_tensor(gguf_name, np.ascontiguousarray(w))
            continue
        type_name = type_of(name) if type_of is not None else ("Q8_0" if "embed" in name else qtype)
        qt = gguf.GGMLQuantizationType[type_name]
        if qt in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32):
            writer.add_tensor(gguf_name, w.astype(np.float16 if type_name == "F16" else np.float32))
            continue
        try:
            data = gguf.quants.quantize(w, qt)
        except NotImplementedError:
            data = random_blocks(type_name, w.shape[0], w.shape[1], seed=zlib.crc32(name.encode()))
        writer.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# Byte offsets of each block's fp16 scale fields (d, and dmin / m where the type has one), by
# the ggml block layouts; MXFP4's one scale is an E8M0 exponent byte at 0.
_FP16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,),
    "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_S": (0,), "TQ1_0": (52,), "TQ2_0": (64,),
}  # fmt: skip


def random_blocks(type_name: str, n: int, k: int, seed: int = 0, std: float = 0.05) -> Any:
    """uint8 [n, row bytes]: random valid ggml blocks of `type_name` (random codes and
    sub-scales) whose fp16 scales are set so the dequantized weights have about `std`."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qt = GGMLQuantizationType[type_name]
    elems, nbytes = GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // elems, nbytes), dtype=np.uint8)
    if type_name == "MXFP4":
        blocks[:, 0] = 127
        spread = dequantize(blocks.reshape(n, -1), qt).std()
        blocks[:, 0] = 127 + int(round(np.log2(std / spread)))
        return blocks.reshape(n, -1)
    fields = _FP16_FIELDS[type_name]
    for f in fields:  # zero scales must give zero weights: the field table is right
        blocks[:, f : f + 2] = np.zeros(1, np.float16).view(np.uint8)
    assert not dequantize(blocks.reshape(n, -1), qt).any(), type_name
    unit = rng.uniform(0.5, 1.5, size=(blocks.shape[0], len(fields))).astype(np.float16)
    for i, f in enumerate(fields):
        blocks[:, f : f + 2] = unit[:, i : i + 1].view(np.uint8)
    spread = float(dequantize(blocks.reshape(n, -1), qt).std())
    for i, f in enumerate(fields):
        blocks[:, f : f + 2] = (unit[:, i : i + 1] * np.float16(std / spread)).view(np.uint8)
    return blocks.reshape(n, -1)


def save_random_model(
    path: str | os.PathLike[str], hf_config: Any, std: float = 0.2, seed: int = 0
) -> Any:
    """Random-weight HF model (float32, eval) saved as safetensors with the tiny tokenizer.

    Every matrix and bias is drawn N(0, std) (std 0.2: peaky logits, so few near-ties in
    greedy comparisons); norm scales 1 +- 0.1 (Gemma's, stored as an offset from 1, +- 0.1).
    Zero biases and unit norms would hide layout mistakes in them.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    gemma = "gemma" in hf_config.model_type
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_norm = "norm" in name or ".ln_" in name
            if is_norm and name.endswith("weight") and not gemma:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif is_norm:
                param.copy_(0.1 * torch.randn_like(param))
            else:
                param.copy_(std * torch.randn_like(param))
    model.save_pretrained(str(path))
    save_tiny_tokenizer(path)
    return model


@dataclass(frozen=True)
class FamilyCase:
    """A tiny random checkpoint of a declared family, for the one family test
    (tests/models/test_families.py), which collects `FAMILY_CASES` from every test module of
    tests/models: a family's own test file lists its cases."""

    name: str
    config: Callable[[], Any]
    """-> a transformers config (its vocab_size is set to the tiny tokenizer's)."""
    fused: bool
    """Decode steps run the compiled forward (models/fused_decode.py)."""
    quantized: tuple[str, ...] = ()
    """Weight formats (int8, int4) whose greedy output is compared with HF's on the same
    quantized-then-dequantized weights."""
    bf16_ulps: int = 4
    """The bfloat16 test's tolerance against HF's bf16 logits, in bf16 ulps (2**-8 of a value)
    of the largest log-prob."""


def dequantized_like_ours(hf_model: Any, method: str) -> Any:
    """A copy of an HF model holding the weights our `quantization=method` load computes with:
    every Linear with in_features % GROUP_SIZE == 0 quantized to the method's bits and back,
    the input embedding and LM head to 8 bits (as loader._prepare_quantization)."""
    import copy

    from pagedllm.kernels import GROUP_SIZE, quantize

    bits = {"int8": 8, "int4": 4}[method]
    model = copy.deepcopy(hf_model)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.in_features % GROUP_SIZE == 0:
                module.weight.copy_(quantize(module.weight, 8 if module is head else bits).dequantize())
        if embedding.weight is not head.weight and embedding.weight.shape[1] % GROUP_SIZE == 0:
            embedding.weight.copy_(quantize(embedding.weight, 8).dequantize())
    return model


@contextlib.contextmanager
def router_margins(hf_model: Any) -> Iterator[list[torch.Tensor]]:
    """While active, every call of an HF MoE router (`*TopKRouter`) appends its tokens' margin
    p_k - p_(k+1) between the k-th and (k+1)-th softmax probabilities ([T] float32): where
    it is tiny, the expert choice is a tie the two implementations may break differently.
    A dense model records nothing."""
    margins: list[torch.Tensor] = []

    def record(module: Any, _inputs: Any, output: Any) -> None:
        probs = torch.softmax(output[0].float(), dim=-1).sort(dim=-1, descending=True).values
        margins.append(probs[:, module.top_k - 1] - probs[:, module.top_k])

    handles = [
        m.register_forward_hook(record) for m in hf_model.modules() if type(m).__name__.endswith("TopKRouter")
    ]
    try:
        yield margins
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def router_choices(hf_model: Any) -> Iterator[list[torch.Tensor]]:
    """While active, every call of an HF MoE router appends its tokens' chosen experts, sorted
    ([T, k] int64)."""
    choices: list[torch.Tensor] = []
    handles = [
        m.register_forward_hook(lambda _m, _i, out: choices.append(out[2].sort(-1).values))
        for m in hf_model.modules()
        if type(m).__name__.endswith("TopKRouter")
    ]
    try:
        yield choices
    finally:
        for h in handles:
            h.remove()


def llama_cpp_dir() -> str | None:
    """The llama.cpp source tree PAGEDLLM_LLAMA_CPP_DIR names, None if it names none."""
    root = os.environ.get("PAGEDLLM_LLAMA_CPP_DIR")
    return root if root and os.path.exists(os.path.join(root, "convert_hf_to_gguf.py")) else None


# llama.cpp's converter in a child process, with one patch: it names a BPE tokenizer's
# pre-tokenizer by a hash of known tokenizers' output, and the tiny tokenizer is none of them
# (tensors and model metadata, what the tests check, do not depend on it).
_CONVERT = """
import runpy, sys
root, src, out, outtype = sys.argv[1:]
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", src, "--outfile", out, "--outtype", outtype]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert_with_llama_cpp(hf_dir: str | os.PathLike[str], out: str | os.PathLike[str], outtype: str) -> None:
    """Write the HF checkpoint (with the tiny tokenizer) as a GGUF by llama.cpp's own
    convert_hf_to_gguf.py (`outtype`: f32, q8_0, ...); llama_cpp_dir() must name a tree."""
    import subprocess
    import sys

    root = llama_cpp_dir()
    assert root is not None, "PAGEDLLM_LLAMA_CPP_DIR names no llama.cpp tree"
    cmd = [sys.executable, "-c", _CONVERT, root, str(hf_dir), str(out), outtype]
    subprocess.run(cmd, check=True, capture_output=True)
