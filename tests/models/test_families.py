"""GPT-2, OPT (pre- and post-norm) and Llama on tiny random-weight checkpoints, through the
real engine, against HF transformers: greedy tokens in float32 (the tie-aware rule of
DESIGN.md), logits in bfloat16 within a stated tolerance, and what --dtype auto picks."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.models.loader import load_model
from tests.models.utils import (
    TINY_BOS_ID,
    TINY_EOS_ID,
    bind_kv_caches,
    prompt_logprobs,
    save_random_model,
)
from tests.utils import TEXT_PROMPTS, assert_greedy_match, hf_greedy

NUM_STEPS = 32
VOCAB = 262  # = len(tiny tokenizer): 256 bytes, 3 merges, <s>, </s>, <|im_end|>
TEXTS = TEXT_PROMPTS


def tiny_config(kind: str) -> Any:
    from transformers import GPT2Config, LlamaConfig, OPTConfig

    ids = dict(bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID)
    if kind == "gpt2":
        return GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, **ids)
    if kind in ("opt", "opt-post-norm"):
        post = kind == "opt-post-norm"  # as OPT-350m: post-norm, embeddings projected in/out
        return OPTConfig(
            vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=256, pad_token_id=1,
            word_embed_proj_dim=32 if post else 64, do_layer_norm_before=not post, **ids,
        )  # fmt: skip
    if kind == "llama":
        return LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **ids,
        )  # fmt: skip
    raise AssertionError(kind)


@pytest.fixture(scope="module", params=["gpt2", "opt", "opt-post-norm", "llama"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, str]:
    path = tmp_path_factory.mktemp(request.param)
    return save_random_model(path, tiny_config(request.param)), str(path)


def test_engine_greedy_matches_hf(tiny: tuple[Any, str]) -> None:
    hf_model, path = tiny
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes="8MiB")
    assert llm.llm_engine.model_config.architecture == hf_model.config.architectures[0]
    params = SamplingParams(max_tokens=NUM_STEPS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(TEXTS, params, use_tqdm=False)
    for text, out in zip(TEXTS, outs):
        ref, gaps = hf_greedy(hf_model, out.prompt_token_ids, NUM_STEPS)
        assert len(out.outputs[0].token_ids) == NUM_STEPS
        assert_greedy_match(out.outputs[0].token_ids, ref, gaps, text)


def test_bfloat16_logits_within_tolerance_of_hf_bfloat16(tiny: tuple[Any, str]) -> None:
    hf_model, path = tiny
    loaded = load_model(path, dtype="bfloat16")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    bind_kv_caches(loaded.model, num_blocks=8, block_size=16)
    prompt = np.random.default_rng(0).integers(0, VOCAB, size=40).tolist()
    ours = prompt_logprobs(loaded.model, prompt)  # [40, vocab] float32
    with torch.inference_mode():
        ref32 = hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        hf16 = hf_model.to(torch.bfloat16)
        ref16 = hf16(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    hf_model.float()  # the module fixture is shared with the float32 test
    # bf16 keeps 8 significant bits: one rounding of a value of magnitude L moves it by up to
    # L * 2**-9, and the two runs round differently in every matmul, norm and softmax over the
    # layers. Allow 4 ulps (2**-6) of the largest log-prob. Measured: 0.06 (GPT-2, OPT) and
    # 0.13 (Llama) against tolerances of ~0.2.
    tol = 2**-6 * float(ref16.abs().max())
    torch.testing.assert_close(ours, ref16, atol=tol, rtol=0)
    # And our bf16 is no further from the float32 truth than HF's own bf16 run is.
    ours_err = float((ours - ref32).abs().max())
    hf_err = float((ref16 - ref32).abs().max())
    assert ours_err <= 1.5 * hf_err, (ours_err, hf_err)


def test_dtype_auto_says_what_it_picked(caplog: pytest.LogCaptureFixture) -> None:
    with open("/proc/cpuinfo") as f:
        native_bf16 = "avx512_bf16" in f.read() or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    with caplog.at_level(logging.INFO, logger="pagedllm.engine.arg_utils"):
        chosen = EngineArgs(dtype="auto").resolve_dtype()
    assert chosen == ("bfloat16" if native_bf16 else "float32")
    assert f"dtype=auto chose {chosen}" in caplog.text


def test_unknown_activation_is_a_clear_error(tmp_path: Path) -> None:
    config = tiny_config("gpt2")
    config.activation_function = "swishy"
    save_random_model(tmp_path, tiny_config("gpt2"))
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="activation 'swishy' is not supported; supported: relu"):
        load_model(str(tmp_path))
