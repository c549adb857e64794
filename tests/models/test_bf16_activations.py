"""`--matmul-activations bf16` (what "auto" chooses on CPUs with native bf16): bf16 weight copies
and torch's bf16 GEMM for matmuls of many rows (kernels/bf16_activations.py), against the float32
path on the same weights: the layer arithmetic, the fused decode, the default model's logprob
drift, stated and bounded, and what "auto" resolves to given a CPU's flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import quantize_int4, quantize_int8, quantized_linear
from pagedllm.kernels import bf16, bf16_activations
from pagedllm.kernels.bf16_activations import (
    BF16_ACTIVATION_MIN_ROWS, bf16_weight_copy,
)
from pagedllm.layers.embedding import LMHead, VocabEmbedding
from pagedllm.layers.linear import Linear, set_prefill_activations
from pagedllm.models.loader import load_model
from tests.models.test_fused_decode import BLOCK_SIZE, compare_decode_steps
from tests.models.test_int8_prefill import PROMPTS, engine, greedy_identical, prompt_drift  # noqa: F401 (engine: a fixture)
from tests.models.test_llama import tiny_config
from tests.models.utils import bind_kv_caches, save_tiny_model


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.bfloat16(), w.bfloat16()).float()


@pytest.mark.parametrize("weight", ["float32", "int8", "int4"])
def test_linear_switches_to_bf16_from_min_rows(weight: str) -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 64)
    layer = Linear(64, 96, bias=True)
    layer.bias.data.normal_()
    if weight == "float32":
        layer.weight.data.copy_(w)
        dense = w
    else:
        layer.quant = (quantize_int8 if weight == "int8" else quantize_int4)(w)
        dense = layer.quant.dequantize()
    x = torch.randn(BF16_ACTIVATION_MIN_ROWS, 64)
    small = x[: BF16_ACTIVATION_MIN_ROWS - 1]
    float_small = layer(small)
    assert layer.use_bf16_activations(BF16_ACTIVATION_MIN_ROWS)
    assert layer.bf16_weight.dtype == torch.bfloat16
    assert torch.equal(layer.bf16_weight, dense.bfloat16())
    # From min_rows up: x and the weight rounded to bf16, the GEMM's bf16 output widened.
    want = _reference(x, dense) + layer.bias
    torch.testing.assert_close(layer(x), want, atol=0, rtol=0)
    # Fewer rows: the float32 path, unchanged.
    assert torch.equal(layer(small), float_small)
    if layer.quant is not None:
        assert torch.equal(float_small, quantized_linear(small, layer.quant, layer.bias))
    # And dropped again.
    assert not layer.use_bf16_activations(None) and layer.bf16_weight is None


def test_a_bf16_weight_takes_no_copy() -> None:
    layer = Linear(32, 32)
    layer.weight.data = layer.weight.data.bfloat16()
    assert not layer.use_bf16_activations(BF16_ACTIVATION_MIN_ROWS)
    assert layer.bf16_weight is None


def test_tied_quantized_lm_head() -> None:
    torch.manual_seed(1)
    table = torch.randn(300, 64)
    embedding = VocabEmbedding(300, 64)
    embedding.quant = quantize_int8(table)
    head = LMHead(300, 64)
    head.tie(embedding)
    x = torch.randn(20, 64)
    assert head.use_bf16_activations(16)
    torch.testing.assert_close(head(x), _reference(x, embedding.quant.dequantize()), atol=0, rtol=0)
    assert torch.equal(head(x[:3]), quantized_linear(x[:3], embedding.quant))


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("quantize", [quantize_int4, quantize_int8])
def test_weight_copy_in_chunks_matches_dequantize(
    monkeypatch: pytest.MonkeyPatch, quantize: Any, compiled: bool
) -> None:
    torch.manual_seed(2)
    q = quantize(torch.randn(1000, 64))  # more rows than one copy chunk, the last one partial
    if not compiled:  # the torch formulation, where the kernels are not built
        monkeypatch.setattr("pagedllm.kernels.quantization.quant_linear_ops", lambda: None)
    assert torch.equal(bf16_weight_copy(q), q.dequantize().bfloat16())


@pytest.mark.parametrize("compiled", [True, False])
def test_weight_copy_of_gguf_parts_matches_their_stacked_dequantized_rows(
    monkeypatch: pytest.MonkeyPatch, compiled: bool
) -> None:
    """A layer's GGUF parts (a fused projection's sections of two types, or a whole weight)
    are copied chunk by chunk into one bf16 matrix: the rows of each part's dequantize()."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from pagedllm.kernels.gguf_blocks import GGUFBlocks

    rng = np.random.default_rng(3)
    parts = []
    for type_name, rows in (("Q4_0", 700), ("Q8_0", 300), ("Q5_1", 20)):
        w = rng.standard_normal((rows, 256)).astype(np.float32)
        parts.append(GGUFBlocks(torch.from_numpy(quantize(w, GGMLQuantizationType[type_name])), type_name, 256))
    q = quantize_int8(torch.randn(40, 256))
    if not compiled:  # the reference dequantizers, where the kernels are not built
        monkeypatch.setattr("pagedllm.kernels.gguf_blocks.gguf_linear_ops", lambda: None)
        monkeypatch.setattr("pagedllm.kernels.quantization.quant_linear_ops", lambda: None)
    want = torch.cat([p.dequantize() for p in parts] + [q.dequantize()]).bfloat16()
    assert torch.equal(bf16_weight_copy([*parts, q]), want)
    assert torch.equal(bf16_weight_copy([parts[0]]), parts[0].dequantize().bfloat16())


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama-bf16")
    save_tiny_model(path, tiny_config("llama"))
    return path


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_fused_decode_takes_the_bf16_copies(tiny_dir: Path, quantization: str) -> None:
    # 23 requests decoding: the compiled forward multiplies with the layers' bf16 copies (the
    # same oneDNN GEMM as the module path: equal), and rebuilds when they change.
    loaded = load_model(str(tiny_dir), quantization=quantization)
    bind_kv_caches(loaded.model, num_blocks=8 * 23 + 1, block_size=BLOCK_SIZE)
    assert set_prefill_activations(loaded.model, "bf16", min_rows=8) > 0
    assert compare_decode_steps(loaded, 23, steps=3, atol=0.0) == 3
    fused = loaded.model.model.fused_layers
    assert fused._bound_bf16 is loaded.model.model.layers[0].self_attn.qkv_proj.bf16_weight is not None
    set_prefill_activations(loaded.model, "float")
    assert compare_decode_steps(loaded, 23, steps=1, atol=0.0 if quantization != "none" else 2e-5) == 1
    assert fused._bound_bf16 is None


def test_bf16_prefill_logprob_drift(engine: tuple[Any, Any]) -> None:
    llm, model = engine
    diff, argmax_same, positions, ppl_ratio = prompt_drift(llm, model, "bf16")
    # Measured (155 positions, Q4_1 default model, bf16 linears and prefill attention): max
    # 0.066, mean 0.0148, ppl -0.38%, argmax the same at 153 of 155 positions (the linears
    # alone: 0.100 / 0.0135 / -0.11% / 154): a fifth of int8 activations' drift (max 0.53,
    # mean 0.070). bf16 keeps 8 significant bits of each activation, weight and output, a
    # relative step of 2^-8 per element, where int8's step is absmax / 127 per group of 32.
    assert diff.max() < 0.4 and diff.mean() < 0.04
    assert abs(ppl_ratio - 1) < 0.01
    assert argmax_same >= 0.95 * positions
    assert diff.max() > 1e-3  # the bf16 GEMM did run


def test_bf16_decode_batch_greedy(engine: tuple[Any, Any]) -> None:
    # 16 prompts decoding together: prefill and every decode step take the bf16 GEMM; the tie
    # rule at twice the drift bound (0.4) (measured: 4 of 16 part, at gaps 0.009-0.061).
    llm, model = engine
    prompts = [f"{p} ({i})" for i in range(4) for p in PROMPTS]
    assert len(prompts) >= BF16_ACTIVATION_MIN_ROWS
    identical = greedy_identical(llm, model, prompts, "bf16", drift_bound=0.4, max_tokens=12)
    assert identical >= len(prompts) // 2


def test_bf16_engine_arg(tiny_llama_dir: Any) -> None:
    import argparse

    from pagedllm import LLM
    from pagedllm.engine.arg_utils import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args(["--matmul-activations", "bf16"])).matmul_activations == "bf16"
    # The old flag is an alias, its "float" is float32.
    assert EngineArgs.from_cli_args(parser.parse_args(["--prefill-activations", "bf16"])).matmul_activations == "bf16"
    float_args = EngineArgs.from_cli_args(parser.parse_args(["--prefill-activations", "float"]))
    assert float_args.matmul_activations == "float32"
    default = EngineArgs.from_cli_args(parser.parse_args([])).matmul_activations
    assert default == "auto" == EngineArgs("m").matmul_activations
    llm = LLM(str(tiny_llama_dir), quantization="int4", matmul_activations="bf16", kv_cache_memory_bytes="16MiB")
    model = llm.llm_engine.engine_core.runner.model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert layers and all(m.bf16_weight is not None and m.bf16_min_rows == BF16_ACTIVATION_MIN_ROWS for m in layers)
    assert model.lm_head.bf16_weight is not None
    # The copies cost 2 bytes a weight (the log line states it).
    weights = sum(m.bf16_weight.numel() for m in [*layers, model.lm_head])
    assert bf16_activations.bf16_copy_bytes(model) == 2 * weights
    with pytest.raises(ValueError, match="tensor-parallel-size 1"):
        LLM(str(tiny_llama_dir), matmul_activations="bf16", tensor_parallel_size=2)


@pytest.mark.parametrize("flags, chosen", [
    ({"avx2", "fma", "avx512f", "avx512_bf16"}, "bf16"),  # Zen 4, Cooper Lake
    ({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "bf16"),  # Sapphire Rapids
    ({"avx2", "fma", "avx512f", "avx512_vnni"}, "float32"),  # Skylake/Cascade Lake: no bf16 unit
    ({"avx2", "fma"}, "float32"),  # Zen 3
])  # fmt: skip
def test_auto_resolves_by_the_cpu_flags(
    platform_matmul_activations: None, monkeypatch: pytest.MonkeyPatch, flags: set[str], chosen: str
) -> None:
    monkeypatch.setattr("pagedllm.platforms.cpu.read_cpu_flags", lambda: frozenset(flags))
    try:
        assert _resolved("auto") == chosen
        # Explicit modes are the user's; tensor parallelism keeps float32.
        assert _resolved("float32") == _resolved("float") == "float32"
        assert _resolved("bf16") == "bf16"
        assert _resolved("auto", tensor_parallel_size=2) == "float32"
    finally:
        monkeypatch.undo()
    with pytest.raises(ValueError, match="matmul_activations='fp8' is not one of auto, float32, int8, bf16"):
        _resolved("fp8")


def _resolved(requested: str, tensor_parallel_size: int = 1) -> str:
    """What the CPU platform makes of `--matmul-activations requested`."""
    from pagedllm.config import EngineConfig, ParallelConfig, QuantizationConfig
    from pagedllm.platforms.registry import get_platform

    config = EngineConfig(quantization_config=QuantizationConfig(requested),
                          parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size))
    return get_platform("cpu").check_and_update_config(config).quantization_config.matmul_activations


def test_auto_engine_takes_the_platform_choice(platform_matmul_activations: None, tiny_llama_dir: Any) -> None:
    from pagedllm import LLM

    llm = LLM(str(tiny_llama_dir), quantization="int4", kv_cache_memory_bytes="16MiB")
    model = llm.llm_engine.engine_core.runner.model
    has_copies = bf16_activations.bf16_copy_bytes(model) > 0
    assert has_copies == bf16.native_bf16()


def test_cuda_refuses_cpu_activation_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.engine.arg_utils import EngineArgs

    from pagedllm.platforms.cuda import CudaPlatform

    monkeypatch.setattr(CudaPlatform, "is_available", classmethod(lambda cls: True))
    args = EngineArgs(model="m", device="cuda", matmul_activations="bf16", attention_backend="triton")
    with pytest.raises(ValueError, match="device='cuda' does not support matmul_activations='bf16'"):
        args.create_engine_config()
    config = EngineArgs(model="m", device="cuda", attention_backend="triton").create_engine_config()
    assert config.quantization_config.matmul_activations == "float32"  # auto: float32 there


def test_auto_keeps_float32_where_the_copies_would_pass_its_limit(
    platform_matmul_activations: None, monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Any
) -> None:
    """auto's bf16 makes a bf16 copy of every weight (2 bytes a weight: 14 GiB for an 8B model);
    past AUTO_BF16_COPY_LIMIT_BYTES of copies the model runs float32, while bf16 by name has no
    limit."""
    from pagedllm import LLM
    from pagedllm.layers.linear import bf16_copy_bytes_needed
    from pagedllm.platforms import cpu

    monkeypatch.setattr("pagedllm.platforms.cpu.read_cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    monkeypatch.setattr(cpu, "AUTO_BF16_COPY_LIMIT_BYTES", 1024)  # the tiny model's copies are more
    small_limit = LLM(str(tiny_llama_dir), quantization="int4", kv_cache_memory_bytes="16MiB")
    model = small_limit.llm_engine.engine_core.runner.model
    assert bf16_copy_bytes_needed(model) > 1024
    assert bf16_activations.bf16_copy_bytes(model) == 0
    named = LLM(str(tiny_llama_dir), quantization="int4", kv_cache_memory_bytes="16MiB", matmul_activations="bf16")
    model = named.llm_engine.engine_core.runner.model
    assert bf16_activations.bf16_copy_bytes(model) == bf16_copy_bytes_needed(model)


@pytest.mark.parametrize("weight", ["int8", "int4", "Q4_K", "float32"])
def test_no_copies_runs_kept_weights_in_bf16_panels(weight: str) -> None:
    """copies=False (auto past its copy limit): no bf16 copy anywhere; a kept weight multiplies
    in bf16 through panels decoded per call (GGUF blocks from min_rows rows up and past the
    small-M kernel's SMALL_M_MAX_ROWS, a QuantizedWeight past PANEL_MAX_ROWS, where its
    compiled kernels stop), with the copy's floats; a float32 weight stays float32."""
    from pagedllm.kernels.gguf_blocks import SMALL_M_MAX_ROWS
    from pagedllm.kernels.quantization import PANEL_MAX_ROWS
    from tests.kernels.test_gguf_kernels import random_blocks

    torch.manual_seed(3)
    layer = Linear(256, 96, bias=True)
    layer.bias.data.normal_()
    if weight == "Q4_K":
        layer.blocks = random_blocks("Q4_K", 96, 256, seed=4)
        dense, first_bf16 = layer.blocks.dequantize(), SMALL_M_MAX_ROWS + 1  # past the small-M kernel
    elif weight == "float32":
        layer.weight.data.normal_()
        dense, first_bf16 = layer.weight.data, None
    else:
        layer.quant = (quantize_int8 if weight == "int8" else quantize_int4)(torch.randn(96, 256))
        dense, first_bf16 = layer.quant.dequantize(), PANEL_MAX_ROWS + 1
    x = torch.randn(PANEL_MAX_ROWS + 40, 256)
    float_out = layer(x)
    below = x[: (first_bf16 or 2) - 1]
    float_below = layer(below)
    assert layer.use_bf16_activations(BF16_ACTIVATION_MIN_ROWS, copies=False) == (weight != "float32")
    assert layer.bf16_weight is None
    if first_bf16 is None:
        assert torch.equal(layer(x), float_out)
        return
    assert layer.bf16_panel_rows() == BF16_ACTIVATION_MIN_ROWS
    torch.testing.assert_close(layer(x[:first_bf16]), _reference(x[:first_bf16], dense) + layer.bias, atol=0, rtol=0)
    assert torch.equal(layer(below), float_below)
    # The same layer with a copy gives the same floats.
    assert layer.use_bf16_activations(BF16_ACTIVATION_MIN_ROWS) and layer.bf16_weight is not None
    assert torch.equal(layer(x[:first_bf16]), _reference(x[:first_bf16], dense) + layer.bias)


def test_auto_past_its_copy_limit_runs_gguf_blocks_in_bf16_panels(
    platform_matmul_activations: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Past auto's copy limit (a 1B model and up) a GGUF model makes no copies but multiplies
    its blocks in bf16 panels (before the panels it fell back to float32): its prompt
    logprobs are the bf16 matmuls', near float32's and not equal to them."""
    from transformers import AutoTokenizer

    from pagedllm import LLM, SamplingParams
    from pagedllm.platforms import cpu
    from tests.models.test_gguf_kept import tiny_kquant_config
    from tests.models.utils import save_tiny_gguf

    hf = save_tiny_model(tmp_path / "hf", tiny_kquant_config())
    path = tmp_path / "tiny-q4k.gguf"
    save_tiny_gguf(path, hf, AutoTokenizer.from_pretrained(tmp_path / "hf"), type_of=lambda name: "Q4_K")
    monkeypatch.setattr("pagedllm.platforms.cpu.read_cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    monkeypatch.setattr(cpu, "AUTO_BF16_COPY_LIMIT_BYTES", 1024)
    kwargs: dict[str, Any] = dict(kv_cache_memory_bytes="16MiB", enable_prefix_caching=False)
    auto = LLM(str(path), **kwargs)
    model = auto.llm_engine.engine_core.runner.model
    assert auto.llm_engine.config.quantization_config.matmul_activations == "bf16"
    assert bf16_activations.bf16_copy_bytes(model) == 0
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.bf16_panel_rows() == BF16_ACTIVATION_MIN_ROWS for m in linears)
    f32 = LLM(str(path), matmul_activations="float32", **kwargs)
    prompt = {"prompt_token_ids": list(range(3, 3 + 2 * BF16_ACTIVATION_MIN_ROWS))}
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    a, b = (llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs[1:] for llm in (auto, f32))
    drift = [abs(next(iter(x.values())).logprob - next(iter(y.values())).logprob) for x, y in zip(a, b)]
    assert 0 < max(drift) < 0.5  # bf16 arithmetic: close to float32, not equal
