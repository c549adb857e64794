"""The random Llama-3.2-1B benchmark's path on a small model of the same family (tied
embeddings, llama3 rope scaling, GQA 4:1): the checkpoint writer, llama.cpp's converter
(where PAGEDLLM_LLAMA_CPP_DIR names a llama.cpp source tree), and the llama3 rope recovered
from the GGUF's rope_freqs, against HF transformers reading the same Q8_0 file."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pagedllm.benchmarks.random_llama_1b import LLAMA_3_2_1B, write_checkpoint
from pagedllm.layers.rotary import llama3_inv_freq
from pagedllm.models.gguf_rope import llama3_rope_from_freq_factors
from pagedllm.models.loader import load_model
from tests.models.test_llama import hf_logprobs
from tests.models.utils import (
    bind_kv_caches,
    greedy_generate,
    prompt_logprobs,
    save_tiny_gguf,
    save_tiny_tokenizer,
)

# Llama-3.2-1B's family shrunk: rope bounds at wavelengths 8 and 64, so short prompts feel them.
SMALL = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
    "max_position_embeddings": 256, "rope_theta": 10000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 8.0, "original_max_position_embeddings": 64},
}  # fmt: skip
PROMPT = [5, 17, 200, 33, 90, 90, 12, 250, 7, 1, 64, 128, 3, 40, 41, 42, 43, 44, 45, 46]


def _freq_factors(theta: float, head_dim: int, scaling: dict[str, Any]) -> np.ndarray:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return (inv / llama3_inv_freq(inv, {**scaling, "rope_type": "llama3"})).numpy()


@pytest.mark.parametrize(
    "theta,head_dim,scaling",
    [
        (LLAMA_3_2_1B["rope_theta"], LLAMA_3_2_1B["head_dim"], LLAMA_3_2_1B["rope_scaling"]),
        (500000.0, 128, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}),  # Llama 3.1 8B
        (SMALL["rope_theta"], SMALL["head_dim"], SMALL["rope_scaling"]),
        (10000.0, 8, {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}),  # one pair in the band
        (10000.0, 16, {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
                       "original_max_position_embeddings": 16}),  # none in the band
    ],
)  # fmt: skip
def test_llama3_rope_recovered_from_freq_factors(theta: float, head_dim: int, scaling: dict[str, Any]) -> None:
    factors = _freq_factors(theta, head_dim, scaling)
    params = llama3_rope_from_freq_factors(factors, theta, head_dim)
    assert params is not None and params["factor"] == scaling["factor"]
    np.testing.assert_allclose(_freq_factors(theta, head_dim, params), factors, rtol=1e-5)
    if scaling["original_max_position_embeddings"] == 8192:  # the real ones come back as written
        assert math.isclose(params["low_freq_factor"], scaling["low_freq_factor"], rel_tol=1e-5)
        assert math.isclose(params["high_freq_factor"], scaling["high_freq_factor"], rel_tol=1e-5)


def test_rope_freqs_that_are_not_llama3() -> None:
    assert llama3_rope_from_freq_factors(np.ones(8), 10000.0, 16) is None
    with pytest.raises(ValueError, match="not a llama3 rope scaling"):
        llama3_rope_from_freq_factors(np.array([1.0, 3.0, 1.5, 4.0, 2.0, 4.0, 4.0, 4.0]), 10000.0, 16)


def _llama_hf_tokenizer() -> Any:
    """A Llama-2-style byte-fallback BPE (llama.cpp's converter takes it without a
    pre-tokenizer hash): <unk> <s> </s>, 256 byte tokens, a few letters."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list("▁abcdefgh")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _converter() -> str | None:
    root = os.environ.get("PAGEDLLM_LLAMA_CPP_DIR")
    path = os.path.join(root, "convert_hf_to_gguf.py") if root else None
    return path if path and os.path.exists(path) else None


def _write_gguf(writer: str, hf_dir: Path, out: Path) -> None:
    """Q8_0 by llama.cpp's converter, or by the tests' own GGUF writer with the rope_freqs
    tensor the converter adds for llama3 rope (so the loader takes the same path)."""
    if writer == "converter":
        converter = _converter()
        assert converter is not None
        cmd = [sys.executable, converter, str(hf_dir), "--outfile", str(out), "--outtype", "q8_0"]
        subprocess.run(cmd, check=True, capture_output=True)
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    factors = _freq_factors(SMALL["rope_theta"], SMALL["head_dim"], SMALL["rope_scaling"])
    save_tiny_gguf(out, model, AutoTokenizer.from_pretrained(str(hf_dir)), "Q8_0",
                   extra=lambda w: w.add_tensor("rope_freqs.weight", factors.astype(np.float32)))  # fmt: skip


_CONVERTER = pytest.param(
    "converter",
    marks=[
        pytest.mark.slow,  # the converter's own start (torch, transformers): ~10 s idle
        pytest.mark.skipif(_converter() is None, reason="PAGEDLLM_LLAMA_CPP_DIR names no llama.cpp tree"),
    ],
)


@pytest.mark.parametrize("writer", [_CONVERTER, "gguf-py"])
def test_small_llama3_q8_0_matches_hf_reading_the_same_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    # The converter's vocabulary path needs a tokenizer it knows; the tests' writer its own.
    tokenizer = _llama_hf_tokenizer() if writer == "converter" else save_tiny_tokenizer(tmp_path / "tok")
    hf_dir = tmp_path / "hf"
    cfg = write_checkpoint(str(hf_dir), tokenizer, std=0.1, overrides={**SMALL, "vocab_size": len(tokenizer)})
    assert (cfg["tie_word_embeddings"], cfg["num_attention_heads"] // cfg["num_key_value_heads"]) == (True, 4)
    gguf_dir = tmp_path / "gguf"  # apart from the HF files, which must not leak into the load
    gguf_dir.mkdir()
    path = gguf_dir / "small-Q8_0.gguf"
    _write_gguf(writer, hf_dir, path)

    loaded = load_model(str(path), quantization="gguf")
    rope = loaded.model.model.layers[0].self_attn.rotary_emb
    ref_config = AutoConfig.from_pretrained(str(hf_dir))  # the checkpoint's llama3 rope
    ref = AutoModelForCausalLM.from_pretrained(
        str(gguf_dir), gguf_file=path.name, config=ref_config, dtype=torch.float32
    ).eval()
    ref_inv = ref.model.rotary_emb.inv_freq
    torch.testing.assert_close(rope.cos_sin_cache[1, : ref_inv.numel()], ref_inv.cos(), atol=1e-6, rtol=0)
    bind_kv_caches(loaded.model, num_blocks=8, block_size=16)
    with torch.no_grad():
        expected = hf_logprobs(ref, PROMPT)
        greedy = list(PROMPT)
        for _ in range(6):  # greedy without generate()'s EOS handling
            greedy.append(int(ref(torch.tensor([greedy])).logits[0, -1].argmax()))
    torch.testing.assert_close(prompt_logprobs(loaded.model, PROMPT), expected, atol=2e-3, rtol=0)
    assert greedy_generate(loaded.model, PROMPT, 6).token_ids == greedy
