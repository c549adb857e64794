"""Gemma 2 on tiny random checkpoints of HF's own Gemma2ForCausalLM, against HF transformers:
greedy tokens in float32 (the tie-aware rule of DESIGN.md) with prompts longer than the tiny
sliding window and generation crossing it, attention and final soft-caps small enough to bite
(and a negative control: without them the output differs), and the llama.cpp GGUF of the
same model, kept quantized and dequantized, against HF reading the same file."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.models.loader import load_model
from tests.models.utils import (
    TINY_BOS_ID,
    TINY_EOS_ID,
    FamilyCase,
    bind_kv_caches,
    prompt_logprobs,
    save_random_model,
    save_tiny_gguf,
)
from tests.utils import assert_greedy_match, hf_greedy

VOCAB = 262
WINDOW = 8
ATTN_CAP, FINAL_CAP = 5.0, 5.0  # small: tanh(s / c) is far from s / c at these models' scores
NUM_STEPS = 24
PROMPT_LEN = 24  # 3 windows; with the generation, positions reach 48 = 6 windows


def tiny_gemma2_config(tied: bool = False) -> Any:
    """Untied by default: a tiny random model with tied embeddings mostly repeats one token
    (greedy sequences that say little); Gemma 2's checkpoints tie, the family case does too."""
    from transformers import Gemma2Config

    # layer_types left to HF's default: even layers slide, odd ones attend fully.
    return Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        sliding_window=WINDOW, query_pre_attn_scalar=24,
        attn_logit_softcapping=ATTN_CAP, final_logit_softcapping=FINAL_CAP, tie_word_embeddings=tied,
        bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID, pad_token_id=0,
    )  # fmt: skip


# For the family test (test_families.py): decode steps run the compiled forward (sandwich
# norms, 1 + w, GELU's tanh form, the attention soft-cap, windowed and full layers' KV in
# cache groups of their own).
FAMILY_CASES = [FamilyCase("gemma2", lambda: tiny_gemma2_config(tied=True), fused=True, quantized=("int8",))]


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, str]:
    path = tmp_path_factory.mktemp("gemma2")
    return save_random_model(path, tiny_gemma2_config()), str(path)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 259, size=PROMPT_LEN + i).tolist() for i in (0, 5)]


def test_layers_take_the_config(tiny_gemma2: tuple[Any, str]) -> None:
    loaded = load_model(tiny_gemma2[1])
    assert loaded.model_config.architecture == "Gemma2ForCausalLM"
    attns = [layer.self_attn.attn for layer in loaded.model.model.layers]
    assert [a.sliding_window for a in attns] == [WINDOW, None, WINDOW, None]
    assert {(a.logit_soft_cap, a.scale) for a in attns} == {(ATTN_CAP, 24**-0.5)}
    assert loaded.model.final_logit_softcap == FINAL_CAP


@pytest.fixture(scope="module")
def hf_references(tiny_gemma2: tuple[Any, str]) -> list[tuple[list[int], list[float]]]:
    """HF's greedy tokens and top-2 gaps for each of _prompts(), computed once."""
    return [hf_greedy(tiny_gemma2[0], p, NUM_STEPS) for p in _prompts()]


@pytest.mark.parametrize("backend", ["paged", "vattention"])
def test_engine_greedy_matches_hf_across_the_window(
    tiny_gemma2: tuple[Any, str], hf_references: list[tuple[list[int], list[float]]], backend: str
) -> None:
    # Prefill in chunks of 16 (continuation chunks read the cache), then decodes: every path
    # of the soft-capped attention, on local and global layers, on both KV backends.
    hf_model, path = tiny_gemma2
    llm = LLM(
        path, dtype="float32", kv_cache_backend=backend, kv_cache_memory_bytes="64MiB", max_model_len=256,
        max_num_batched_tokens=16, max_num_seqs=4, block_size=4,
    )  # fmt: skip
    params = SamplingParams(max_tokens=NUM_STEPS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    for out, (ref, gaps) in zip(outs, hf_references):
        assert len(out.prompt_token_ids) > 2 * WINDOW
        assert len(out.outputs[0].token_ids) == NUM_STEPS
        assert_greedy_match(out.outputs[0].token_ids, ref, gaps, f"gemma2 {len(out.prompt_token_ids)} tokens")
    if backend != "paged":
        return
    # 2 global layers, 2 local ones: one KV cache group of each kind (the kernel's windows).
    windows = [spec.sliding_window for spec in llm.llm_engine.scheduler.kv_cache_manager.group_specs]
    assert sorted(windows, key=str) == [8, None], windows
    # Negative control: HF without the attention soft-cap decodes otherwise. (The final cap
    # is monotonic and keeps the argmax: its control is on logprobs, below.)
    uncapped = copy.deepcopy(hf_model)
    for layer in uncapped.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    for out in outs:
        assert hf_greedy(uncapped, out.prompt_token_ids, NUM_STEPS)[0] != out.outputs[0].token_ids


def test_the_soft_caps_bite(tiny_gemma2: tuple[Any, str], tmp_path: Path) -> None:
    # Prompt logprobs within 1e-4 of HF's; and the negative control: the same weights with
    # either cap removed give other logprobs, so the matches depend on both caps being applied.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_model, path = tiny_gemma2
    prompt = _prompts()[0]
    logprobs = {}
    variants = {"both": (ATTN_CAP, FINAL_CAP), "no_attn": (None, FINAL_CAP), "no_final": (ATTN_CAP, None)}
    for name, (attn_cap, final_cap) in variants.items():
        model_path = path
        if name != "both":
            model_path = str(tmp_path / name)
            overrides = dict(attn_logit_softcapping=attn_cap, final_logit_softcapping=final_cap)
            AutoModelForCausalLM.from_pretrained(path, **overrides).save_pretrained(model_path)
            AutoTokenizer.from_pretrained(path).save_pretrained(model_path)
        loaded = load_model(model_path)
        assert {layer.self_attn.attn.logit_soft_cap for layer in loaded.model.model.layers} == {attn_cap}
        bind_kv_caches(loaded.model, num_blocks=16, block_size=4)
        logprobs[name] = prompt_logprobs(loaded.model, prompt, block_size=4)
    with torch.inference_mode():
        ref = hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    torch.testing.assert_close(logprobs["both"], ref, atol=1e-4, rtol=0)
    for name in ("no_attn", "no_final"):
        assert float((logprobs[name] - logprobs["both"]).abs().max()) > 0.1, name


@pytest.fixture(scope="module")
def tiny_gemma2_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tied model (as Gemma 2's GGUFs are: no output.weight; transformers 5.24 does not load
    a Gemma 2 GGUF's untied output.weight) written as llama.cpp's Q8_0 GGUF."""
    from transformers import AutoTokenizer

    hf_dir = tmp_path_factory.mktemp("gemma2-gguf")
    hf_model = save_random_model(hf_dir, tiny_gemma2_config(tied=True))
    path = hf_dir / "gguf" / "tiny-gemma2-Q8_0.gguf"  # apart from the HF files, which must not leak in
    path.parent.mkdir()
    save_tiny_gguf(path, hf_model, AutoTokenizer.from_pretrained(hf_dir), "Q8_0", arch="gemma2")
    return path


def test_gguf_config_and_names(tiny_gemma2_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tiny_gemma2_gguf.parent / "cache"))
    loaded = load_model(str(tiny_gemma2_gguf))
    assert (loaded.quantization, loaded.model_config.architecture) == ("gguf", "Gemma2ForCausalLM")
    # The soft-caps come from the file's gemma2.* keys (transformers' reader leaves its
    # defaults, 50 and 30), the scale from head_dim as llama.cpp takes it.
    attns = [layer.self_attn.attn for layer in loaded.model.model.layers]
    assert {(a.logit_soft_cap, a.scale) for a in attns} == {(ATTN_CAP, 16**-0.5)}
    assert [a.sliding_window for a in attns] == [WINDOW, None, WINDOW, None]
    assert loaded.model.final_logit_softcap == FINAL_CAP


def test_gguf_kept_quantized_matches_dequantized_and_hf(
    tiny_gemma2_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tiny_gemma2_gguf.parent / "cache"))
    prompt = _prompts()[1]
    logprobs = {}
    for method in ("gguf", "none"):
        loaded = load_model(str(tiny_gemma2_gguf), quantization=method)
        assert loaded.quantization == method
        assert bool(loaded.model.model.layers[0].self_attn.qkv_proj.kept_weights()) == (method == "gguf")
        bind_kv_caches(loaded.model, num_blocks=16, block_size=4)
        logprobs[method] = prompt_logprobs(loaded.model, prompt, block_size=4)
    torch.testing.assert_close(logprobs["gguf"], logprobs["none"], atol=1e-4, rtol=0)
    # HF reading the same file: its GGUF reader does not read the soft-cap keys nor derive
    # the scale (it keeps Gemma2Config's defaults), so those three are given to it as the
    # file states them (llama.cpp's reading, which ours follows).
    hf_config = AutoConfig.from_pretrained(str(tiny_gemma2_gguf.parent), gguf_file=tiny_gemma2_gguf.name)
    assert (hf_config.attn_logit_softcapping, hf_config.query_pre_attn_scalar) == (50.0, 256)
    hf = AutoModelForCausalLM.from_pretrained(
        str(tiny_gemma2_gguf.parent), gguf_file=tiny_gemma2_gguf.name, dtype=torch.float32,
        attn_logit_softcapping=ATTN_CAP, final_logit_softcapping=FINAL_CAP, query_pre_attn_scalar=16,
    ).eval()  # fmt: skip
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    torch.testing.assert_close(logprobs["none"], ref, atol=1e-4, rtol=0)
    llm = LLM(str(tiny_gemma2_gguf), dtype="float32", kv_cache_memory_bytes="8MiB", block_size=4)
    params = SamplingParams(max_tokens=NUM_STEPS, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    ref_tokens, gaps = hf_greedy(hf, prompt, NUM_STEPS)
    assert_greedy_match(out.outputs[0].token_ids, ref_tokens, gaps, "gemma2 GGUF kept quantized vs HF")
