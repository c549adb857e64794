"""Gemma 3 (text) on a tiny random-weight checkpoint through the real engine, against HF
transformers: greedy tokens in float32 (the tie-aware rule of DESIGN.md), with prompts
longer than the tiny sliding window so local and global layers see different context."""

from __future__ import annotations

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
from tests.utils import TEXT_PROMPTS, assert_greedy_match, hf_greedy

NUM_STEPS = 32
VOCAB = 262
WINDOW = 12
TEXTS = TEXT_PROMPTS


def tiny_gemma3_config(window: int = WINDOW) -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        sliding_window=window,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        query_pre_attn_scalar=24, final_logit_softcapping=30.0,
        bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID, pad_token_id=0,
    )  # fmt: skip


# For the family test (test_families.py): decode steps run the compiled forward (sandwich
# norms, 1 + w, GELU's tanh form, q/k norms, a rotary table per layer kind, the windowed and
# full layers' KV in cache groups of their own).
FAMILY_CASES = [FamilyCase("gemma3", tiny_gemma3_config, fused=True, quantized=("int8", "int4"))]


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, str]:
    path = tmp_path_factory.mktemp("gemma3")
    return save_random_model(path, tiny_gemma3_config()), str(path)


def test_model_config(tiny_gemma3: tuple[Any, str]) -> None:
    loaded = load_model(tiny_gemma3[1])
    cfg = loaded.model_config
    assert (cfg.architecture, cfg.sliding_window, cfg.num_kv_heads, cfg.head_dim) == (
        "Gemma3ForCausalLM", WINDOW, 2, 16,
    )  # fmt: skip
    windows = [layer.self_attn.attn.sliding_window for layer in loaded.model.model.layers]
    assert windows == [WINDOW, WINDOW, None, WINDOW]


def test_prompt_logprobs_match_hf(tiny_gemma3: tuple[Any, str]) -> None:
    hf_model, path = tiny_gemma3
    loaded = load_model(path)
    bind_kv_caches(loaded.model, num_blocks=16, block_size=4)
    prompt = np.random.default_rng(0).integers(0, VOCAB, size=3 * WINDOW).tolist()
    ours = prompt_logprobs(loaded.model, prompt, block_size=4)
    with torch.inference_mode():
        ref = hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_engine_greedy_matches_hf(tiny_gemma3: tuple[Any, str]) -> None:
    hf_model, path = tiny_gemma3
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes="8MiB", max_num_batched_tokens=256)
    long_prompt = np.random.default_rng(1).integers(0, VOCAB, size=100).tolist()
    prompts: list[Any] = list(TEXTS[:7]) + [{"prompt_token_ids": long_prompt}]
    params = SamplingParams(max_tokens=NUM_STEPS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs[-1].prompt_token_ids) > 8 * WINDOW
    for out in outs:
        ref, gaps = hf_greedy(hf_model, out.prompt_token_ids, NUM_STEPS)
        assert len(out.outputs[0].token_ids) == NUM_STEPS
        assert_greedy_match(out.outputs[0].token_ids, ref, gaps, str(out.prompt))


def test_long_request_holds_window_sized_kv_on_sliding_layers(tiny_gemma3: tuple[Any, str]) -> None:
    hf_model, path = tiny_gemma3
    block_size = 4
    llm = LLM(
        path, dtype="float32", kv_cache_memory_bytes="8MiB", block_size=block_size,
        max_num_batched_tokens=16, max_num_seqs=4,
    )  # fmt: skip
    engine = llm.llm_engine
    manager = engine.scheduler.kv_cache_manager
    # 1 global and 3 local layers: groups of one layer each, the global one first.
    assert [spec.sliding_window for spec in manager.group_specs] == [None, WINDOW, WINDOW, WINDOW]
    prompt = np.random.default_rng(2).integers(0, VOCAB, size=150).tolist()
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    req_id = engine.add_request(None, params, prompt_token_ids=prompt)
    held: list[list[int]] = []
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        held.append(manager.get_num_held_blocks(req_id))
    # Each step computes at most 16 tokens; they and the 11 positions before them (the
    # window) span at most cdiv(16 + 11, 4) + 1 blocks, however they fall on block edges.
    # The full-attention group holds the whole sequence: the last observed step (before the
    # one that finishes and frees) has computed positions 0..195 -> 49 blocks.
    window_blocks = max(max(h[1:]) for h in held[:-1])
    assert window_blocks <= -(-(16 + WINDOW - 1) // block_size) + 1
    assert max(h[0] for h in held[:-1]) == -(-(150 + 48 - 2) // block_size)
    # Once decoding, one token per step: the window alone, cdiv(11, 4) + 1 blocks at most.
    assert max(max(h[1:]) for h in held[-40:-1]) <= -(-(WINDOW - 1) // block_size) + 1
    assert held[-1] == [0, 0, 0, 0]  # finished: everything freed
    ref, gaps = hf_greedy(hf_model, prompt, 48)
    assert_greedy_match(tokens, ref, gaps, "long prompt, windowed KV")


def test_kv_cache_groups_are_equal_sized() -> None:
    from pagedllm.layers.attention import Attention
    from pagedllm.kv_backends.paged.worker import allocate_kv_caches, kv_cache_groups

    # Gemma 3 270M's pattern: 5 local layers, then 1 global, 3 times.
    windows = ([512] * 5 + [None]) * 3
    layers = [Attention(4, 16, 2, 0.25, sliding_window=w) for w in windows]
    groups = kv_cache_groups(layers)
    assert [(g.sliding_window, g.layer_indices) for g in groups] == [
        (None, [5, 11, 17]), (512, [0, 1, 2]), (512, [3, 4, 6]), (512, [7, 8, 9]),
        (512, [10, 12, 13]), (512, [14, 15, 16]),
    ]  # fmt: skip
    caches = allocate_kv_caches(layers, num_blocks=4, block_size=2, dtype="float32")
    assert len(caches) == 3  # a block spans 3 layer slices
    assert layers[5].kv_cache is caches[0] and layers[5].kv_cache_group == 0
    assert layers[16].kv_cache is caches[2] and layers[16].kv_cache_group == 5


def test_gguf_rope_scaling_of_global_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 3 4B and up: llama.cpp's converter writes the global layers' linear x8 rope as
    gemma3.rope.scaling.type / .factor, which transformers' GGUF reader drops; ours reads them
    (GGUFSpec.config_from_gguf). A float32 file against HF on the same weights and scaling."""
    from transformers import AutoTokenizer, Gemma3TextConfig

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    config = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        sliding_window=WINDOW, final_logit_softcapping=None,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID, pad_token_id=0,
    )  # fmt: skip
    hf_model = save_random_model(tmp_path, config)

    def scaling(writer: Any) -> None:
        writer.add_string("gemma3.rope.scaling.type", "linear")
        writer.add_float32("gemma3.rope.scaling.factor", 8.0)

    path = tmp_path / "gguf" / "tiny-gemma3.gguf"
    path.parent.mkdir()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    save_tiny_gguf(path, hf_model, tokenizer, arch="gemma3", extra=scaling, type_of=lambda name: "F32")
    loaded = load_model(str(path))
    full = loaded.hf_config.rope_parameters["full_attention"]
    assert (full["rope_type"], full["factor"]) == ("linear", 8.0)
    assert loaded.hf_config.rope_parameters["sliding_attention"]["rope_type"] == "default"
    bind_kv_caches(loaded.model, num_blocks=32, block_size=16)
    prompt = list(range(3, 200, 2))  # 99 positions: a x8 scaling is visible
    ours = prompt_logprobs(loaded.model, prompt)
    with torch.inference_mode():
        ref = hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
