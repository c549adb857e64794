"""Qwen3 on tiny random checkpoints: its cases for the family test (greedy vs HF, float32 and
int8 / int4, fused decode), the q/k norm in the compiled decode against the module path, and
a GGUF file of llama.cpp's "qwen3" names against HF reading the same file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm.models.fused_decode import declared_layout
from pagedllm.models.loader import load_model
from tests.models.test_fused_decode import BLOCK_SIZE, compare_decode_steps
from tests.models.utils import (
    TINY_BOS_ID,
    TINY_EOS_ID,
    FamilyCase,
    bind_kv_caches,
    prompt_logprobs,
    save_random_model,
    save_tiny_gguf,
)

PROMPT = [5, 17, 200, 33, 90, 90, 12, 250, 7, 1, 64, 128, 3]


def tiny_qwen3_config(tied_bias: bool = False) -> Any:
    # head_dim != hidden / heads, as Qwen3-0.6B (128 against 1024 / 16); 128 is also what
    # transformers assumes reading a qwen3 GGUF (it maps no head-dim key). The family test
    # sets the vocabulary to the tiny tokenizer's; the decode prompts here reach id 300.
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32 if tied_bias else 128,
        max_position_embeddings=256, rms_norm_eps=1e-6, attention_bias=tied_bias,
        tie_word_embeddings=tied_bias, bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID,
    )  # fmt: skip


FAMILY_CASES = [
    FamilyCase("qwen3", tiny_qwen3_config, fused=True, quantized=("int8", "int4")),
    FamilyCase("qwen3-tied-bias", lambda: tiny_qwen3_config(tied_bias=True), fused=True),
]


@pytest.fixture(scope="module", params=["plain", "tied-bias"])
def tiny_qwen3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    path = tmp_path_factory.mktemp(f"qwen3-{request.param}")
    return save_random_model(path, tiny_qwen3_config(request.param == "tied-bias")), path


def test_layers_declare_the_qk_norm_layout(tiny_qwen3: tuple[Any, Path]) -> None:
    loaded = load_model(str(tiny_qwen3[1]))
    cfg = loaded.model_config
    hf = tiny_qwen3[0].config
    assert (cfg.architecture, cfg.head_dim, cfg.num_kv_heads) == ("Qwen3ForCausalLM", hf.head_dim, 2)
    assert hf.head_dim != hf.hidden_size // hf.num_attention_heads
    for layer in loaded.model.model.layers:
        layout = declared_layout(layer)
        assert layout is not None and layout.arch.qk_norm
        assert (layout.arch.qkv_bias, layout.arch.o_bias) == (hf.attention_bias, hf.attention_bias)
        # The declared architecture is what the modules were built from.
        a = layer.self_attn
        assert (a.qkv_proj.bias is not None, a.o_proj.bias is not None) == (hf.attention_bias, hf.attention_bias)


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("num_reqs", [1, 3, 11])
def test_fused_qk_norm_matches_module_path(tiny_qwen3: tuple[Any, Path], quantization: str, num_reqs: int) -> None:
    # As test_fused_decode: the same kernels either way (the q/k norm is layer_ops' RMSNorm
    # in both), float32 weights up to GEMM summation order, quantized exactly.
    loaded = load_model(str(tiny_qwen3[1]), quantization=quantization)
    bind_kv_caches(loaded.model, num_blocks=8 * num_reqs + 1, block_size=BLOCK_SIZE)
    atol = 2e-5 if quantization == "none" else 0.0
    assert compare_decode_steps(loaded, num_reqs, steps=5, atol=atol) == 5


def test_gguf_matches_hf_reading_the_same_file(tmp_path_factory: pytest.TempPathFactory) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir = tmp_path_factory.mktemp("qwen3-gguf")
    hf_model = save_random_model(hf_dir, tiny_qwen3_config())
    path = hf_dir / "tiny-qwen3.gguf"
    save_tiny_gguf(path, hf_model, AutoTokenizer.from_pretrained(hf_dir), "Q8_0", arch="qwen3")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE_DIR", str(hf_dir / "cache"))
        loaded = load_model(str(path))
    assert (loaded.quantization, loaded.model_config.architecture) == ("gguf", "Qwen3ForCausalLM")
    bind_kv_caches(loaded.model, num_blocks=8, block_size=16)
    ours = prompt_logprobs(loaded.model, PROMPT)
    ref_model = AutoModelForCausalLM.from_pretrained(str(hf_dir), gguf_file=path.name, dtype=torch.float32)
    with torch.inference_mode():
        ref = ref_model.eval()(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)
    # Q8_0 blocks: the small-M kernel's int16 activation rounding (measured 4.1e-4)
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=0)
