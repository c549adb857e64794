"""The one family test: every declared family (models/family.py), on the tiny checkpoints its
own test module lists as `FAMILY_CASES`, through the real engine against HF transformers:
greedy tokens in float32 (the tie-aware rule of DESIGN.md), with the fused decode taken
exactly where the case says; int8 / int4 greedy against HF on the same dequantized weights;
bfloat16 logits within a stated tolerance; the declaration against the checkpoint's names."""

from __future__ import annotations

import importlib
import logging
import pkgutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tests.models
from pagedllm import LLM, SamplingParams
from pagedllm.config import LoadConfig
from pagedllm.engine.core_builder import resolve_dtype
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.layers.moe import SparseMoE
from pagedllm.models import registry
from pagedllm.models.fused_decode import FusedDecoderLayers
from pagedllm.models.config_utils import architecture_of, head_dim_of, num_kv_heads_of
from pagedllm.models.loader import load_model
from pagedllm.models.weights import iter_safetensors, safetensors_files
from tests.models.utils import (
    FamilyCase,
    bind_kv_caches,
    dequantized_like_ours,
    prompt_logprobs,
    router_choices,
    router_margins,
    save_random_model,
)
from tests.utils import TEXT_PROMPTS, assert_greedy_match, hf_greedy

NUM_STEPS = 32
ROUTER_TIE_BF16 = 2**-6
VOCAB = 262  # = len(tiny tokenizer): 256 bytes, 3 merges, <s>, </s>, <|im_end|>


def _collect_cases() -> list[FamilyCase]:
    cases: list[FamilyCase] = []
    for info in sorted(pkgutil.iter_modules(tests.models.__path__), key=lambda m: m.name):
        if info.name.startswith("test_") and info.name != "test_families":
            module = importlib.import_module(f"tests.models.{info.name}")
            cases.extend(getattr(module, "FAMILY_CASES", ()))
    return cases


CASES = _collect_cases()
QUANTIZED = [(case, method) for case in CASES for method in case.quantized]
_saved: dict[str, tuple[Any, str]] = {}


def _checkpoint(case: FamilyCase, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, str]:
    """(HF model, directory) of the case's random checkpoint, saved once per session."""
    if case.name not in _saved:
        config = case.config()
        config.vocab_size = VOCAB
        path = tmp_path_factory.mktemp(case.name)
        _saved[case.name] = save_random_model(path, config), str(path)
    return _saved[case.name]


def _engine_greedy(path: str, quantization: str | None = None) -> tuple[Any, list[Any], int]:
    """(engine, outputs, fused decode calls) for the tiny prompts, greedy, in float32."""
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes="8MiB", quantization=quantization)
    model = llm.llm_engine.engine_core.runner.model
    fused = next((m for m in model.modules() if isinstance(m, FusedDecoderLayers)), None)
    calls: list[int] = []
    handle = None if fused is None else fused.register_forward_hook(lambda *_: calls.append(1))
    params = SamplingParams(max_tokens=NUM_STEPS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(TEXT_PROMPTS, params, use_tqdm=False)
    if handle is not None:
        handle.remove()
    return llm, outs, len(calls)


def test_every_declared_architecture_has_a_case() -> None:
    """Of the generating text families; the pooling ones have theirs in test_pooling_models.py,
    the vision-language ones (family.image) in tests/multimodal/."""
    covered = {architecture_of(case.config()) for case in CASES}
    generating = {a for f in registry.families() if f.runner == "generate" and f.image is None
                  for a in f.architectures}
    assert generating <= covered, generating - covered


def _hf_holds(hf_names: set[str], prefix: str, part: str) -> bool:
    """The HF checkpoint holds the tensor a GGUF block tensor of `prefix` (a layer) comes from:
    `part`'s weight, a bare parameter (gpt-oss's sinks), or, for one expert's projection, the
    3-D stack of every expert's (gpt-oss's: gate and up fused, split by llama.cpp's converter)."""
    if f"{prefix}.{part}.weight" in hf_names or f"{prefix}.{part}" in hf_names:
        return True
    stem, _, proj = part.rpartition(".")  # "mlp.experts.0", "gate_proj"
    fused = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}.get(proj, proj)
    return stem.endswith(".experts.0") and f"{prefix}.{stem.removesuffix('.0')}.{fused}" in hf_names


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_declaration_matches_the_checkpoint(case: FamilyCase, tmp_path_factory: pytest.TempPathFactory) -> None:
    hf_model, path = _checkpoint(case, tmp_path_factory)
    family = registry.family_of(architecture_of(hf_model.config))
    arch = family.arch_config(hf_model.config)
    # HF's in-memory names and the saved checkpoint's (transformers 5 keeps experts as 3-D
    # tensors in memory and saves them per expert, as the released checkpoints name them).
    hf_names = set(hf_model.state_dict()) | {name for name, _ in iter_safetensors(safetensors_files(path))}
    assert (arch.head_dim, arch.num_kv_heads) == (head_dim_of(hf_model.config), num_kv_heads_of(hf_model.config))
    loaded = load_model(path)
    assert type(loaded.model) is family.model_class
    ours = {name for name, _ in loaded.model.named_parameters()}
    for fused, packed, _ in family.packed_modules:
        assert any(f".{packed}." in n for n in hf_names) and any(f".{fused}." in n for n in ours), (fused, packed)
    if family.gguf is not None:  # every declared GGUF tensor has its HF tensor
        for hf_part in family.gguf.block_names.values():
            # In some layer: a MoE family's dense layers and sparse ones hold different MLPs.
            part = hf_part.format(expert=0)
            layers = range(arch.num_layers)
            assert any(_hf_holds(hf_names, f"{family.gguf.block_prefix}.{i}", part) for i in layers), hf_part
        assert {f"{n}.weight" for n in family.gguf.global_names.values()} <= hf_names


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_engine_greedy_matches_hf(case: FamilyCase, tmp_path_factory: pytest.TempPathFactory) -> None:
    hf_model, path = _checkpoint(case, tmp_path_factory)
    llm, outs, fused_calls = _engine_greedy(path)
    assert llm.llm_engine.model_config.architecture == architecture_of(hf_model.config)
    for text, out in zip(TEXT_PROMPTS, outs):
        ref, gaps = hf_greedy(hf_model, out.prompt_token_ids, NUM_STEPS)
        assert len(out.outputs[0].token_ids) == NUM_STEPS
        assert_greedy_match(out.outputs[0].token_ids, ref, gaps, f"{case.name}: {text}")
    # The decode steps (all but each prompt's first token) ran fused, or none did.
    assert (fused_calls >= NUM_STEPS - 1) if case.fused else fused_calls == 0, fused_calls


@pytest.mark.parametrize(("case", "method"), QUANTIZED, ids=lambda v: getattr(v, "name", v))
def test_quantized_greedy_matches_hf_on_the_same_weights(
    case: FamilyCase, method: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    hf_model, path = _checkpoint(case, tmp_path_factory)
    reference = dequantized_like_ours(hf_model, method)
    llm, outs, fused_calls = _engine_greedy(path, quantization=method)
    assert llm.llm_engine.scheduler.kv_cache_manager.hash_extra_keys[-1] == method  # the weight format
    for text, out in zip(TEXT_PROMPTS, outs):
        ref, gaps = hf_greedy(reference, out.prompt_token_ids, NUM_STEPS)
        assert_greedy_match(out.outputs[0].token_ids, ref, gaps, f"{case.name} {method}: {text}")
    assert (fused_calls >= NUM_STEPS - 1) if case.fused else fused_calls == 0, fused_calls


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bfloat16_logits_within_tolerance_of_hf_bfloat16(
    case: FamilyCase, tmp_path_factory: pytest.TempPathFactory
) -> None:
    hf_model, path = _checkpoint(case, tmp_path_factory)
    loaded = load_model(path, dtype="bfloat16")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    bind_kv_caches(loaded.model, num_blocks=8, block_size=16)
    prompt = np.random.default_rng(0).integers(0, VOCAB, size=40).tolist()
    ours_routes: list[torch.Tensor] = []  # per sparse layer, [40, k] expert ids
    for moe in (m for m in loaded.model.modules() if isinstance(m, SparseMoE)):
        moe.register_forward_hook(lambda m, *_: ours_routes.append(m.last_routing.expert_ids.sort(-1).values))
    ours = prompt_logprobs(loaded.model, prompt)  # [40, vocab] float32
    with torch.inference_mode():
        ref32 = hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        hf16 = hf_model.to(torch.bfloat16)
        # As from_pretrained(dtype=bfloat16) leaves them, and as ours are: rotary tables in
        # float32 (.to() casts their inv_freq buffers too, which moves a long rope's angles).
        for module in hf16.modules():
            if type(module).__name__.endswith("RotaryEmbedding"):
                module.float()
        with router_margins(hf16) as margins, router_choices(hf16) as hf_routes:
            ref16 = hf16(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    hf_model.float()  # the checkpoint's HF model is shared with the float32 tests
    # Mixture of experts: a token routed to other experts here than by HF's bf16 router is a
    # different computation; allowed only where HF chose its k-th expert over the (k+1)-th by
    # a margin under ROUTER_TIE_BF16 (a few bf16 steps of a probability: a tie, as in the
    # greedy rule), and that row is not compared (measured: 1 of 40 rows, margin 2.8e-3, in
    # qwen3-moe-sparse-step). Most rows must remain.
    keep = torch.ones(len(prompt), dtype=torch.bool)
    assert len(ours_routes) == len(margins)
    for route, margin, hf_route in zip(ours_routes, margins, hf_routes):
        rerouted = (route != hf_route).any(-1)
        assert bool((margin[rerouted] < ROUTER_TIE_BF16).all()), (margin[rerouted], route, hf_route)
        keep &= ~rerouted
    assert int(keep.sum()) >= 0.75 * len(prompt), int(keep.sum())
    ours, ref16, ref32 = ours[keep], ref16[keep], ref32[keep]
    # bf16 keeps 8 significant bits: one rounding of a value of magnitude L moves it by up to
    # L * 2**-9, and the two runs round differently in every matmul, norm and softmax over the
    # layers. Allow 4 ulps (2**-6) of the largest log-prob by default. Measured: 0.06 (GPT-2, OPT) and
    # 0.13 (Llama) against tolerances of ~0.2. A case may allow more (FamilyCase.bf16_ulps)
    # where HF's own bf16 run is that far from float32.
    tol = case.bf16_ulps * 2**-8 * float(ref16.abs().max())
    torch.testing.assert_close(ours, ref16, atol=tol, rtol=0)
    # And our bf16 is no further from the float32 truth than HF's own bf16 run is.
    ours_err = float((ours - ref32).abs().max())
    hf_err = float((ref16 - ref32).abs().max())
    assert ours_err <= 1.5 * hf_err, (ours_err, hf_err)


def test_dtype_auto_says_what_it_picked(caplog: pytest.LogCaptureFixture) -> None:
    with open("/proc/cpuinfo") as f:
        native_bf16 = "avx512_bf16" in f.read() or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    with caplog.at_level(logging.INFO, logger="pagedllm.platforms.cpu"):
        chosen = resolve_dtype(LoadConfig(dtype="auto", quantization="none"), CpuPlatform())
    assert chosen == ("bfloat16" if native_bf16 else "float32")
    assert f"dtype=auto chose {chosen}" in caplog.text


def test_dtype_auto_picks_float32_for_quantized_weights() -> None:
    # The 4/8-bit kernels and the fused decode take float32 activations, native bf16 or not:
    # asked for (int8) or by default (the default model's Q4_1 file keeps its blocks).
    cpu = CpuPlatform()
    assert resolve_dtype(LoadConfig(dtype="auto", quantization="int8"), cpu) == "float32"
    assert resolve_dtype(LoadConfig(dtype="auto"), cpu) == "float32"
    assert resolve_dtype(LoadConfig(dtype="bfloat16"), cpu) == "bfloat16"
    # An assembled package's GGUF (Gemma 3 270M's Q4_K_M), built or not yet: kept quantized.
    assert resolve_dtype(LoadConfig(model="gemma-3-270m", dtype="auto"), cpu) == "float32"
