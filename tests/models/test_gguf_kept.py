"""GGUF matrices kept in their file's type (models/gguf_quant.py), on tiny Llama GGUFs of each
type, against HF transformers reading the same file (`gguf_file=`: gguf-py dequantizes it).

Bounds (float32 activations): |d logprob| <= 1e-3 for every kept type, DESIGN.md's logprob
rule (matmuls of 17+ rows dequantize the same blocks to the same float32 values, so only
summation order differs; up to 16 rows the compiled kernel rounds the activations to int16 per
group of 32, at most 1/65534 of the group's largest |x|: measured up to 2e-4 here);
0.1 for the types dequantized to BF16 (IQ2_XXS, TQ2_0: bf16 rounding of each weight, 2^-9
relative, correlated within a block that shares one scale). Greedy is equal by DESIGN.md's
tie rule for the kept types; for the BF16 ones a first divergence must fall at a reference
top-2 gap below twice their bound. Types gguf-py cannot quantize are written as random valid
blocks (tests/models/utils.random_blocks), the same bytes for both sides.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm.kernels import QuantizedWeight
from pagedllm.kernels.gguf_blocks import GGUFBlocks
from pagedllm.layers.embedding import LMHead, VocabEmbedding
from pagedllm.layers.linear import Linear
from pagedllm.models import gguf_loader, memory_check
from pagedllm.models.loader import LoadedModel, load_model
from tests.models.test_llama import PROMPT, hf_logprobs
from pagedllm.benchmarks.latency import _linear_weights
from tests.models.utils import bind_kv_caches, greedy_generate, prompt_logprobs, save_tiny_gguf, save_tiny_model
from tests.utils import assert_greedy_match, hf_greedy

KEPT = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
        "IQ4_NL", "IQ4_XS", "MXFP4", "F16", "BF16"]  # fmt: skip
DEQUANTIZED = ["IQ2_XXS", "TQ2_0"]
BOUND = {t: 1e-3 for t in KEPT} | {t: 0.1 for t in DEQUANTIZED}
NUM_STEPS = 8


def tiny_kquant_config(tied: bool = False) -> Any:
    """A Llama whose every matrix width is whole 256-element super-blocks (K-quants, IQ4_XS)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied, bos_token_id=259, eos_token_id=260,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    path = tmp_path_factory.mktemp("tiny-kquant")
    return save_tiny_model(path, tiny_kquant_config()), path


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def write(tiny: tuple[Any, Path], name: str, type_of: Any) -> Path:
    from transformers import AutoTokenizer

    hf_model, hf_dir = tiny
    path = hf_dir / f"{name}.gguf"
    save_tiny_gguf(path, hf_model, AutoTokenizer.from_pretrained(hf_dir), type_of=type_of)
    return path


def hf_from_gguf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def assert_no_float_matrix(loaded: LoadedModel) -> None:
    """Every matrix is held in a kept form: no dequantized (float) projection or table."""
    for name, module in loaded.model.named_modules():
        if isinstance(module, Linear):
            assert module.kept_weights() and module.weight.numel() == 0, name
        elif isinstance(module, (VocabEmbedding, LMHead)) and not getattr(module, "_tied", None):
            assert (module.quant is not None or module.blocks is not None) and module.weight.numel() == 0, name


def file_tensor_bytes(path: Path) -> int:
    index = gguf_loader.gguf_index(str(path))
    return sum(t.num_bytes for t in index.tensors)


def check_against_hf(path: Path, loaded: LoadedModel, bound: float) -> None:
    bind_kv_caches(loaded.model, num_blocks=8, block_size=16)
    ref = hf_from_gguf(path)
    ours = prompt_logprobs(loaded.model, PROMPT)
    torch.testing.assert_close(ours, hf_logprobs(ref, PROMPT), atol=bound, rtol=0)
    req = greedy_generate(loaded.model, PROMPT, NUM_STEPS)
    ref_tokens, gaps = hf_greedy(ref, PROMPT, NUM_STEPS)
    ours = req.token_ids[len(PROMPT):]
    if bound <= 1e-3:
        assert_greedy_match(ours, ref_tokens, gaps, path.name)
        return
    # BF16-dequantized weights: the tie rule is for float32 weights; here a first divergence
    # must fall where the reference's top-2 gap is within twice the stated logprob bound.
    diverged = next((i for i, (a, b) in enumerate(zip(ours, ref_tokens)) if a != b), None)
    assert diverged is None or gaps[diverged] < 2 * bound, (diverged, gaps, ours, ref_tokens)


@pytest.mark.parametrize("qtype", KEPT + DEQUANTIZED)
def test_each_type_kept_matches_hf(tiny_hf: tuple[Any, Path], qtype: str) -> None:
    # Every matrix of the type: projections, the embedding (gathered) and the untied head.
    path = write(tiny_hf, f"all-{qtype}", lambda name: qtype)
    loaded = load_model(str(path))
    assert loaded.quantization == "gguf"
    assert_no_float_matrix(loaded)
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj
    want = QuantizedWeight if qtype in ("Q4_0", "Q4_1") else GGUFBlocks
    assert isinstance(qkv.kept_weights()[0], want)
    if qtype in DEQUANTIZED:
        assert qkv.blocks is not None and qkv.blocks.type_name == "BF16"
    elif qtype != "Q4_0":  # Q4_0 is held as QuantizedWeight: 20 bytes a group for 18
        file_bytes = file_tensor_bytes(path)
        assert abs(loaded.weight_bytes - file_bytes) <= 0.03 * file_bytes, (loaded.weight_bytes, file_bytes)
    check_against_hf(path, loaded, BOUND[qtype])
    # Decode steps ran compiled, for QuantizedWeight and block layers alike.
    fused = loaded.model.model.fused_layers
    assert fused._unsupported is None and fused._decoder is not None


# One file mixing types inside each fused projection, as Q4_K_M files do (Q6_K attn_v and
# ffn_down in some layers), with QuantizedWeight (Q4_1) and block parts side by side.
MIXED = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q5_0", "gate_proj": "Q4_1",
         "up_proj": "Q4_K", "down_proj": "Q6_K", "embed_tokens": "Q6_K", "lm_head": "Q4_K"}  # fmt: skip


def _mixed_type(name: str) -> str:
    part = name.split(".")[-2]
    if ".layers.1." in name and part == "v_proj":
        return "Q4_K"  # layer 1's qkv all Q4_K: one block weight
    return MIXED[part]


def test_mixed_types_in_fused_projections(tiny_hf: tuple[Any, Path]) -> None:
    path = write(tiny_hf, "mixed", _mixed_type)
    loaded = load_model(str(path))
    assert_no_float_matrix(loaded)
    layers = loaded.model.model.layers
    qkv0, qkv1 = layers[0].self_attn.qkv_proj, layers[1].self_attn.qkv_proj
    assert qkv0.sections is not None and [w.type_name for _, w in qkv0.sections] == ["Q4_K", "Q4_K", "Q6_K"]
    assert [o for o, _ in qkv0.sections] == [0, 256, 384]
    assert qkv1.blocks is not None and qkv1.blocks.type_name == "Q4_K"
    gate_up = layers[0].mlp.gate_up_proj
    assert gate_up.sections is not None
    assert isinstance(gate_up.sections[0][1], QuantizedWeight) and gate_up.sections[1][1].type_name == "Q4_K"
    file_bytes = file_tensor_bytes(path)
    assert abs(loaded.weight_bytes - file_bytes) <= 0.03 * file_bytes
    # `bench latency`'s bytes a decode step reads: every matrix's kept bytes but the table.
    index = gguf_loader.gguf_index(str(path))
    matmul_bytes = sum(t.num_bytes for t in index.tensors if len(t.dims) == 2 and t.name != "token_embd.weight")
    assert abs(_linear_weights(loaded.model)[1] - matmul_bytes) <= 0.03 * matmul_bytes
    check_against_hf(path, loaded, 1e-3)


def test_dequantize_and_requantize_per_tensor(tiny_hf: tuple[Any, Path]) -> None:
    # --quantization none / int8 on a file of kept types: read tensor by tensor.
    path = write(tiny_hf, "mixed-none", _mixed_type)
    none = load_model(str(path), quantization="none")
    assert none.model.model.layers[0].self_attn.qkv_proj.weight.shape == (512, 256)
    check_against_hf(path, none, 1e-3)
    int8 = load_model(str(path), quantization="int8")
    assert int8.model.model.layers[0].self_attn.qkv_proj.quant is not None


def test_no_weights_in_the_cache(tiny_hf: tuple[Any, Path], cache_dir: Path) -> None:
    path = write(tiny_hf, "cache-Q6_K", lambda name: "Q6_K")
    loaded = load_model(str(path))
    names = os.listdir(loaded.model_dir)
    assert "model.safetensors" not in names and not any(n.endswith(".safetensors") for n in names)
    assert {"config.json", "gguf_index.json"} <= set(names)


def test_refused_when_it_does_not_fit(tiny_hf: tuple[Any, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tiny_hf, "big-Q4_K", lambda name: "Q4_K")
    monkeypatch.setattr(memory_check, "available_memory", lambda: memory_check.AvailableMemory(200_000, 150_000))
    message = (r"does not fit in memory: its weights take 0\.00 GiB and the smallest KV pool .* GiB, but only "
               r"0\.00 GiB is available \(MemAvailable .*, cgroup limit leaves .*\); use a smaller quant")
    with pytest.raises(ValueError, match=message):
        load_model(str(path))
    monkeypatch.setattr(memory_check, "available_memory", lambda: memory_check.AvailableMemory(1 << 40, None))
    assert load_model(str(path)).quantization == "gguf"


def test_prefill_activations_on_block_layers(tiny_hf: tuple[Any, Path]) -> None:
    """--prefill-activations bf16 takes a bf16 copy of a block layer's dequantized weight;
    both bf16 and int8 set the block layers' decode activations to int8 (K-quant blocks round
    them per 256 in the small-M kernel, which this short prompt takes; int8 rounds
    QuantizedWeight parts per 32 too). The modes' own bounds are stated and tested on real
    weights (test_int8_prefill.py, test_bf16_activations.py, test_int8_decode_drift.py); here,
    on random weights of std 0.05, |d logprob| <= 0.5 (measured up to 0.33) shows the block and
    section paths take part, and "float" returns exactly to the float32 path."""
    from pagedllm.layers.linear import set_prefill_activations

    path = write(tiny_hf, "prefill-mixed", _mixed_type)
    loaded = load_model(str(path))
    bind_kv_caches(loaded.model, num_blocks=8, block_size=16)
    ref = prompt_logprobs(loaded.model, PROMPT)
    assert set_prefill_activations(loaded.model, "int8", min_rows=1) > 0
    torch.testing.assert_close(prompt_logprobs(loaded.model, PROMPT), ref, atol=0.5, rtol=0)
    assert set_prefill_activations(loaded.model, "bf16", min_rows=1) > 0
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj
    assert qkv.sections is not None and qkv.bf16_weight is not None and qkv.bf16_weight.shape == (512, 256)
    torch.testing.assert_close(prompt_logprobs(loaded.model, PROMPT), ref, atol=0.5, rtol=0)
    set_prefill_activations(loaded.model, "float")
    torch.testing.assert_close(prompt_logprobs(loaded.model, PROMPT), ref, atol=0, rtol=0)
