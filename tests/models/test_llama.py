"""Our Llama-family model vs HF transformers on tiny random-weight checkpoints."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm.models.loader import LoadedModel, load_model
from tests.models.utils import (
    TINY_BOS_ID,
    FamilyCase,
    TINY_EOS_ID,
    TINY_IM_END_ID,
    RequestState,
    allocate_blocks,
    bind_kv_caches,
    greedy_generate,
    prompt_logprobs,
    save_tiny_model,
    step,
)

BLOCK_SIZE = 4  # small, so a prompt spans several blocks
PROMPT = [5, 17, 200, 33, 90, 90, 12, 250, 7, 1, 64, 128, 3]
TOL = 1e-4


def tiny_config(kind: str) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common: dict[str, Any] = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        bos_token_id=TINY_BOS_ID,
        eos_token_id=TINY_EOS_ID,
    )
    if kind == "llama":
        return LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
    if kind == "llama-tied-bias":
        return LlamaConfig(**common, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)
    if kind == "llama3-rope":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
        return LlamaConfig(**common, rope_parameters=rope)
    if kind == "mistral-window":
        return MistralConfig(**common, head_dim=16, sliding_window=6)
    if kind == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    raise AssertionError(kind)


KINDS = ["llama", "llama-tied-bias", "llama3-rope", "mistral-window", "qwen2"]


def family_llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=262, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID,
    )  # fmt: skip


# For the family test (test_families.py), one case per family declared in models/llama.py
# (the Llama variants of KINDS are this module's); each decodes through the fused forward.
FAMILY_CASES = [
    FamilyCase("llama", family_llama_config, fused=True, quantized=("int8", "int4")),
    FamilyCase("mistral-window", functools.partial(tiny_config, "mistral-window"), fused=True),
    FamilyCase("qwen2", functools.partial(tiny_config, "qwen2"), fused=True),
]


@pytest.fixture(scope="module", params=KINDS)
def tiny(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, LoadedModel]:
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_tiny_model(path, tiny_config(request.param))
    loaded = load_model(str(path))
    bind_kv_caches(loaded.model, num_blocks=32, block_size=BLOCK_SIZE)
    return hf_model, loaded


@torch.inference_mode()
def hf_logprobs(hf_model: Any, token_ids: list[int]) -> torch.Tensor:
    logits = hf_model(torch.tensor([token_ids])).logits[0]  # [T, vocab]
    return logits.float().log_softmax(-1)


def test_prompt_logprobs_match_hf(tiny: tuple[Any, LoadedModel]) -> None:
    hf_model, loaded = tiny
    ours = prompt_logprobs(loaded.model, PROMPT, BLOCK_SIZE)
    ref = hf_logprobs(hf_model, PROMPT)
    torch.testing.assert_close(ours, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("prefill_chunk", [None, 5])
def test_greedy_decode_matches_hf(tiny: tuple[Any, LoadedModel], prefill_chunk: int | None) -> None:
    hf_model, loaded = tiny
    req = greedy_generate(loaded.model, PROMPT, 8, BLOCK_SIZE, prefill_chunk=prefill_chunk)
    ref = hf_logprobs(hf_model, req.token_ids)[len(PROMPT) - 1 : -1]  # [8, vocab]
    torch.testing.assert_close(torch.stack(req.logprobs), ref, atol=TOL, rtol=0)
    assert req.token_ids[len(PROMPT) :] == ref.argmax(-1).tolist()


def test_batched_requests_match_single(tiny: tuple[Any, LoadedModel]) -> None:
    # Two prompts prefilled in one flat batch, then decoded together (decodes first).
    hf_model, loaded = tiny
    prompts = [PROMPT, [9, 8, 7, 6, 5, 4, 3]]
    reqs = [
        RequestState(list(prompts[0]), allocate_blocks(len(prompts[0]) + 4, BLOCK_SIZE)),
        RequestState(list(prompts[1]), allocate_blocks(len(prompts[1]) + 4, BLOCK_SIZE, 10)),
    ]
    step(loaded.model, [(r, len(r.token_ids)) for r in reqs], BLOCK_SIZE)
    for _ in range(3):
        for r in reqs:
            r.token_ids.append(int(r.logprobs[-1].argmax()))
        step(loaded.model, [(r, 1) for r in reqs], BLOCK_SIZE)
    for r in reqs:
        n = len(r.token_ids) - len(r.logprobs) + 1  # prompt length
        ref = hf_logprobs(hf_model, r.token_ids)[n - 1 :]
        torch.testing.assert_close(torch.stack(r.logprobs), ref, atol=TOL, rtol=0)


def test_sharded_checkpoint(tmp_path: Path) -> None:
    hf_model = save_tiny_model(tmp_path, tiny_config("llama"), max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = load_model(str(tmp_path))
    bind_kv_caches(loaded.model, num_blocks=8, block_size=BLOCK_SIZE)
    ours = prompt_logprobs(loaded.model, PROMPT, BLOCK_SIZE)
    torch.testing.assert_close(ours, hf_logprobs(hf_model, PROMPT), atol=TOL, rtol=0)


def test_bfloat16(tmp_path: Path) -> None:
    hf_model = save_tiny_model(tmp_path, tiny_config("llama"))
    loaded = load_model(str(tmp_path), dtype="bfloat16")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.model_config.dtype == "bfloat16"
    bind_kv_caches(loaded.model, num_blocks=8, block_size=BLOCK_SIZE)
    ours = prompt_logprobs(loaded.model, PROMPT, BLOCK_SIZE)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, hf_logprobs(hf_model, PROMPT), atol=0.1, rtol=0)


def test_model_config_and_tokenizer(tiny: tuple[Any, LoadedModel]) -> None:
    hf_model, loaded = tiny
    cfg, hf_cfg = loaded.model_config, hf_model.config
    assert cfg.architecture == hf_cfg.architectures[0]
    assert (cfg.vocab_size, cfg.num_layers, cfg.num_kv_heads) == (320, 3, 2)
    assert cfg.head_dim == 16 and cfg.max_model_len == 128
    # </s>, then the end-of-turn <|im_end|> (and <|endoftext|>, which Qwen2's tokenizer adds)
    assert cfg.eos_token_ids[:2] == (TINY_EOS_ID, TINY_IM_END_ID)
    assert cfg.bos_token_id == TINY_BOS_ID
    assert cfg.sliding_window == (6 if hf_cfg.model_type == "mistral" else None)
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("hi there")) == "hi there"
    assert loaded.gguf_path is None


def test_missing_shard_is_an_error(tiny: tuple[Any, LoadedModel]) -> None:
    hf_model, loaded = tiny
    state = hf_model.state_dict()
    weights = [(n, t) for n, t in state.items() if "layers.1.self_attn.k_proj" not in n]
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.qkv_proj.weight\[k\]"):
        loaded.model.load_weights(weights)
    with pytest.raises(ValueError, match=r"model.norm.weight(,|$)"):
        loaded.model.load_weights((n, t) for n, t in state.items() if n != "model.norm.weight")
    loaded.model.load_weights(state.items())  # restore
