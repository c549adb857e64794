"""The compiled decode forward (models/fused_decode.py) on weights kept as GGUF blocks, against
the module path on the same steps (tests/models/test_fused_decode.py's comparison).

Both paths run the same kernels in the same order on the same floats: up to
SMALL_M_MAX_ROWS rows gguf_matmul.h's small-M kernel, above it the same rows decoded to
float32 and torch's GEMM on the same chunks. So the hidden states must be equal bit for bit
(atol 0) at 1, 3 (small-M) and 23 rows (decode + GEMM), and every decode step must have run
fused (the forward hook's count). On a CPU above AVX2 the mixed model runs again with both
extensions built for AVX2 (the float path in place of the int16 VNNI one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm.kernels import QuantizedWeight, detect_cpu_isa, isa_at_least, set_cpu_isa
from pagedllm.kernels.build import kernel_cache_root
from pagedllm.kernels.gguf_blocks import SMALL_M_MAX_ROWS, GGUFBlocks
from pagedllm.layers.linear import Linear
from pagedllm.models.fused_decode import FUSED_MAX_ROWS
from pagedllm.models.loader import LoadedModel, load_model
from tests.models.test_fused_decode import BLOCK_SIZE, VERIFY_STEPS, compare_decode_steps, compare_verify_steps
from tests.models.test_gguf_kept import _mixed_type, tiny_hf, write  # noqa: F401 (tiny_hf: a fixture)
from tests.models.utils import bind_kv_caches

# 1 and 3 rows: the small-M kernel; 23: decoded rows and torch's GEMM.
NUM_REQS = [1, 3, 23]
assert max(NUM_REQS[:2]) <= SMALL_M_MAX_ROWS < NUM_REQS[2] <= FUSED_MAX_ROWS


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # The converted models' files in the test's directory; the compiled kernels where they are.
    monkeypatch.setenv("PAGEDLLM_KERNEL_CACHE_DIR", kernel_cache_root())
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _projections(loaded: LoadedModel) -> list[Linear]:
    return [m for layer in loaded.model.model.layers for m in layer.modules() if isinstance(m, Linear)]


def _assert_decodes_fused(loaded: LoadedModel, num_reqs: int) -> None:
    bind_kv_caches(loaded.model, num_blocks=8 * num_reqs + 1, block_size=BLOCK_SIZE)
    assert compare_decode_steps(loaded, num_reqs, steps=5, atol=0.0) == 5
    assert loaded.model.model.fused_layers._unsupported is None


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "IQ4_XS"])
@pytest.mark.parametrize("num_reqs", NUM_REQS)
def test_fused_decode_on_gguf_blocks(tiny_hf: tuple[Any, Path], qtype: str, num_reqs: int) -> None:
    loaded = load_model(str(write(tiny_hf, f"fused-{qtype}", lambda name: qtype)))
    for m in _projections(loaded):
        assert m.blocks is not None and m.blocks.type_name == qtype
    _assert_decodes_fused(loaded, num_reqs)


@pytest.mark.parametrize("num_reqs", NUM_REQS)
def test_fused_decode_on_q8_0_blocks(tiny_hf: tuple[Any, Path], num_reqs: int) -> None:
    # The loader keeps Q8_0 as the file's blocks (they dequantize to what the QuantizedWeight
    # form holds), and the fused decode takes them.
    loaded = load_model(str(write(tiny_hf, "fused-Q8_0", lambda name: "Q8_0")))
    for m in _projections(loaded):
        assert m.quant is None and m.blocks is not None and m.blocks.type_name == "Q8_0"
    _assert_decodes_fused(loaded, num_reqs)


@pytest.mark.parametrize("num_reqs", NUM_REQS)
def test_fused_decode_on_mixed_sections(tiny_hf: tuple[Any, Path], num_reqs: int) -> None:
    # Layer 0's qkv: Q4_K q/k and Q6_K v sections; gate_up: a Q4_1 QuantizedWeight and Q4_K
    # blocks; o_proj a Q5_0 block weight, down_proj Q6_K; layer 1's qkv one Q4_K weight.
    loaded = load_model(str(write(tiny_hf, "fused-mixed", _mixed_type)))
    layer0 = loaded.model.model.layers[0]
    assert [w.type_name for _, w in layer0.self_attn.qkv_proj.sections] == ["Q4_K", "Q4_K", "Q6_K"]
    assert isinstance(layer0.mlp.gate_up_proj.sections[0][1], QuantizedWeight)
    _assert_decodes_fused(loaded, num_reqs)


def test_fused_verification_on_mixed_sections(tiny_hf: tuple[Any, Path]) -> None:
    # Decodes and verification runs of up to 5 rows and a prompt's last chunk: every step fused.
    loaded = load_model(str(write(tiny_hf, "fused-mixed-verify", _mixed_type)))
    bind_kv_caches(loaded.model, num_blocks=48, block_size=BLOCK_SIZE)
    steps = len(VERIFY_STEPS)
    assert compare_verify_steps(loaded, atol=0.0) == (steps, steps)


@pytest.mark.skipif(not isa_at_least(detect_cpu_isa(), "avx512"), reason="the CPU's own level is AVX2 or lower")
@pytest.mark.parametrize("num_reqs", [1, 23])
def test_fused_decode_on_mixed_sections_at_avx2(tiny_hf: tuple[Any, Path], num_reqs: int) -> None:
    path = write(tiny_hf, "fused-mixed-avx2", _mixed_type)
    try:
        assert set_cpu_isa("avx2") == "avx2"
        loaded = load_model(str(path))
        _assert_decodes_fused(loaded, num_reqs)
        # The AVX2 build ran, though this process may hold the native level's too.
        assert type(loaded.model.model.fused_layers._decoder).__module__ == "pagedllm_decode_layers_avx2"
    finally:
        set_cpu_isa(None)


def test_fused_decode_takes_the_bf16_copies_of_block_layers(tiny_hf: tuple[Any, Path]) -> None:
    # --prefill-activations bf16 from 8 rows: block and section layers' bf16 copies of their
    # dequantized rows (the same oneDNN GEMM as the module path: equal) at 23 rows; at 3 rows
    # below the threshold the blocks' own kernels.
    from pagedllm.layers.linear import set_prefill_activations

    loaded = load_model(str(write(tiny_hf, "fused-mixed-bf16", _mixed_type)))
    assert set_prefill_activations(loaded.model, "bf16", min_rows=8) > 0
    assert loaded.model.model.layers[0].self_attn.qkv_proj.sections is not None
    for num_reqs in (23, 3):
        _assert_decodes_fused(loaded, num_reqs)
    assert loaded.model.model.fused_layers._bound_bf16 is not None


def test_fused_decode_takes_the_bf16_panels_of_block_layers(tiny_hf: tuple[Any, Path]) -> None:
    # bf16 without copies (auto past its copy limit) from 8 rows: GGUF block layers (whole and
    # sections) decode bf16 panels per call in both paths, equal at 23 rows; the QuantizedWeight
    # section's panels start past PANEL_MAX_ROWS, beyond a fused step: its own kernels in both.
    from pagedllm.layers.linear import set_prefill_activations

    loaded = load_model(str(write(tiny_hf, "fused-mixed-panels", _mixed_type)))
    assert set_prefill_activations(loaded.model, "bf16", min_rows=8, copies=False) > 0
    layer0 = loaded.model.model.layers[0]
    assert layer0.self_attn.qkv_proj.bf16_panel_rows() == 8 and layer0.self_attn.qkv_proj.bf16_weight is None
    for num_reqs in (23, 3):
        _assert_decodes_fused(loaded, num_reqs)
    assert loaded.model.model.fused_layers._bound_panel_rows == 8
