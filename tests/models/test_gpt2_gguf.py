"""GPT-2 GGUF files (llama.cpp's `gpt2` architecture; models/gpt2.py's GGUFSpec), written as
llama.cpp's converter writes them (fused `attn_qkv` with bias, the Conv1D weights transposed to
[out, in], `position_embd` in F32, no `output` when the head is tied), against HF transformers
reading the same file (`gguf_file=`: gguf-py dequantizes it, its GPT2TensorProcessor
transposes the matrices back to Conv1D).

Bounds (float32 activations), those of test_gguf_kept.py: |d logprob| <= 1e-3 for F32 and the
kept types (the same dequantized values on both sides; only summation order and, up to 16
rows, the compiled kernel's int16 activation rounding differ), and greedy equal by DESIGN.md's
tie rule.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

from pagedllm.kernels.gguf_blocks import GGUFBlocks
from pagedllm.layers.linear import Linear
from pagedllm.models.loader import load_model
from tests.models.test_llama import PROMPT, hf_logprobs
from tests.models.utils import (
    TINY_BOS_ID,
    TINY_EOS_ID,
    add_tiny_vocab,
    bind_kv_caches,
    convert_with_llama_cpp,
    greedy_generate,
    gguf_tensor_name,
    llama_cpp_dir,
    prompt_logprobs,
    random_blocks,
    save_random_model,
    save_tiny_tokenizer,
)
from tests.utils import assert_greedy_match, hf_greedy

BOUND = 1e-3
NUM_STEPS = 8
# HF's Conv1D weights, [in, out]; the converter writes their transpose.
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def tiny_gpt2_config(tied: bool = True) -> Any:
    """Every matrix's input width a whole number of 256-element super-blocks (Q4_K)."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=262, n_embd=256, n_layer=2, n_head=4, n_positions=128,
        tie_word_embeddings=tied, bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID,
    )  # fmt: skip


def save_gpt2_gguf(path: Path, hf_model: Any, tokenizer: Any, type_of: Callable[[str], str]) -> None:
    """The HF GPT-2 as llama.cpp's GPT2Model converter writes it; `type_of(hf_name)` is each
    matrix's type (vectors and the position table stay F32, as the converter and
    llama-quantize leave them). A type gguf-py cannot quantize gets random valid blocks."""
    import gguf

    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_name("tiny-gpt2")
    writer.add_block_count(cfg.n_layer)
    writer.add_context_length(cfg.n_positions)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_feed_forward_length(4 * cfg.n_embd)
    writer.add_head_count(cfg.n_head)
    writer.add_layer_norm_eps(cfg.layer_norm_epsilon)
    add_tiny_vocab(writer, tokenizer, cfg.vocab_size)
    for name, tensor in hf_model.state_dict().items():
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # causal-mask buffers
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.float().numpy()
        if name.endswith(_CONV1D):
            w = w.T  # Conv1D [in, out] -> [out, in]
        gguf_name = gguf_tensor_name(name, "gpt2")
        if w.ndim == 1 or gguf_name == "position_embd.weight":
            writer.add_tensor(gguf_name, np.ascontiguousarray(w))
            continue
        type_name = type_of(name)
        qt = gguf.GGMLQuantizationType[type_name]
        if type_name in ("F32", "F16"):
            writer.add_tensor(gguf_name, np.ascontiguousarray(w, dtype=np.float32 if type_name == "F32" else np.float16))
            continue
        try:
            data = gguf.quants.quantize(np.ascontiguousarray(w), qt)
        except NotImplementedError:
            data = random_blocks(type_name, w.shape[0], w.shape[1], seed=len(name) + w.shape[0])
        writer.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))


def _write(tmp_path: Path, tied: bool, type_of: Callable[[str], str]) -> Path:
    src = tmp_path / "src"
    hf_model = save_random_model(src, tiny_gpt2_config(tied))
    path = tmp_path / "gguf" / "tiny-gpt2.gguf"
    path.parent.mkdir()
    save_gpt2_gguf(path, hf_model, save_tiny_tokenizer(tmp_path / "tok"), type_of)
    return path


def _hf_from_gguf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    # Its reader leaves n_positions at GPT2Config's 1024 (real GPT-2 files have 1024 rows;
    # these have 128): pass the file's, as our loader reads it (test below).
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, n_positions=128
    ).eval()


def _check_against_hf(path: Path, model: Any, bound: float = BOUND) -> None:
    ref = _hf_from_gguf(path)
    bind_kv_caches(model, num_blocks=8, block_size=16)
    torch.testing.assert_close(prompt_logprobs(model, PROMPT), hf_logprobs(ref, PROMPT), atol=bound, rtol=0)
    ours = greedy_generate(model, PROMPT, NUM_STEPS).token_ids[len(PROMPT) :]
    ref_tokens, gaps = hf_greedy(ref, PROMPT, NUM_STEPS)
    assert_greedy_match(ours, ref_tokens, gaps, path.name)


# (matrix type, embedding / head type): F32 throughout, Q8_0, Q4_K and Q6_K (kept as the
# file's blocks).
TYPES = [("F32", "F32"), ("Q8_0", "Q8_0"), ("Q4_K", "Q8_0"), ("Q6_K", "Q6_K")]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize(("qtype", "table_type"), TYPES, ids=[t for t, _ in TYPES])
def test_gpt2_gguf_kept_matches_hf_on_the_same_file(tmp_path: Path, qtype: str, table_type: str, tied: bool) -> None:
    path = _write(tmp_path, tied, lambda name: table_type if name.endswith(("wte.weight", "lm_head.weight")) else qtype)
    loaded = load_model(str(path))
    assert loaded.model_config.architecture == "GPT2LMHeadModel"
    assert loaded.model.tie_word_embeddings == tied
    kept = {"F32": torch.Tensor}.get(qtype, GGUFBlocks)
    for name, module in loaded.model.named_modules():
        if isinstance(module, Linear):
            if kept is torch.Tensor:
                assert module.weight.shape == (module.out_features, module.in_features), name
            else:  # kept as the file has it, no float copy
                assert isinstance(module.kept_weights()[0], kept) and module.weight.numel() == 0, name
                assert module.kept_weights()[0].shape == (module.out_features, module.in_features), name
    # Q8_0 blocks: the small-M kernel's int16 activation rounding (measured up to 1.007e-3)
    _check_against_hf(path, loaded.model, 2e-3 if qtype == "Q8_0" else BOUND)


def test_gpt2_gguf_dequantized_matches_hf(tmp_path: Path) -> None:
    # --quantization none: every matrix dequantized to float32 as it loads, the Conv1D ones
    # through the same transposed hand-over.
    path = _write(tmp_path, True, lambda name: "Q4_K" if "mlp" in name else "Q8_0")
    loaded = load_model(str(path), quantization="none")
    assert all(m.quant is None and m.blocks is None for m in loaded.model.modules() if isinstance(m, Linear))
    _check_against_hf(path, loaded.model)


def test_gpt2_gguf_position_table_sets_the_context(tmp_path: Path) -> None:
    # transformers' reader puts the file's context_length into n_ctx, which GPT2Config no
    # longer reads; the loader takes it from position_embd (128 rows, not GPT2Config's 1024).
    path = _write(tmp_path, True, lambda name: "Q8_0")
    loaded = load_model(str(path))
    assert loaded.model_config.max_model_len == 128
    assert loaded.model.transformer.wpe.weight.shape == (128, 256)


def test_gpt2_gguf_through_the_engine(tmp_path: Path) -> None:
    # The file alone (its tokenizer and config from the metadata cache), served greedy.
    from pagedllm import LLM, SamplingParams

    path = _write(tmp_path, True, lambda name: "Q4_K" if "mlp" in name else "Q8_0")
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes="4MiB")
    assert llm.llm_engine.model_config.architecture == "GPT2LMHeadModel"
    params = SamplingParams(max_tokens=NUM_STEPS, temperature=0.0, ignore_eos=True)
    out = llm.generate(["the theme of the thesis"], params, use_tqdm=False)[0]
    ref, gaps = hf_greedy(_hf_from_gguf(path), out.prompt_token_ids, NUM_STEPS)
    assert_greedy_match(out.outputs[0].token_ids, ref, gaps, "gpt2 gguf engine")


@pytest.mark.slow  # the converter's own start (torch, transformers)
@pytest.mark.skipif(llama_cpp_dir() is None, reason="PAGEDLLM_LLAMA_CPP_DIR names no llama.cpp tree")
@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_gpt2_written_by_llama_cpp_converter(tmp_path: Path, outtype: str) -> None:
    src = tmp_path / "src"
    hf_model = save_random_model(src, tiny_gpt2_config(True))
    config = json.loads((src / "config.json").read_text())
    config.setdefault("n_ctx", config["n_positions"])  # the converter reads n_ctx, as OpenAI's config.json has it
    (src / "config.json").write_text(json.dumps(config))
    path = tmp_path / "gguf" / f"tiny-gpt2-{outtype}.gguf"
    path.parent.mkdir()
    convert_with_llama_cpp(src, path, outtype)
    loaded = load_model(str(path))
    if outtype == "q8_0":
        assert all(isinstance(m.blocks, GGUFBlocks) and m.blocks.type_name == "Q8_0"
                   for m in loaded.model.modules() if isinstance(m, Linear))
    _check_against_hf(path, loaded.model)
    if outtype == "f32":  # the file holds the source's weights exactly: HF's own GPT-2 agrees
        bind_kv_caches(loaded.model, num_blocks=8, block_size=16)
        torch.testing.assert_close(prompt_logprobs(loaded.model, PROMPT), hf_logprobs(hf_model, PROMPT), atol=BOUND, rtol=0)
