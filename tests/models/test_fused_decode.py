"""The compiled decode forward (models/fused_decode.py) against the module-by-module path.

Both run the same decode steps over the same KV cache (a step writes the same K/V rows either
way), so each step's hidden states can be compared directly; the fused path must also have
run (a forward hook counts its calls) and fall back where it does not apply, including a
layer whose class does not declare what it computes.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm.attention.metadata import AttentionMetadata, forward_context
from pagedllm.attention.params import AttentionParams
from pagedllm.models.family import ArchConfig
from pagedllm.models.fused_decode import (
    FUSED_MAX_ROWS,
    KERNEL_MAX_QUERY_RUN,
    DecodeLayout,
    attention_refusal,
    declared_layout,
    kernel_refusal,
)
from pagedllm.models.llama import LlamaDecoderLayer
from pagedllm.models.loader import LoadedModel, load_model
from tests.models.test_llama import tiny_config
from tests.models.utils import (
    RequestState,
    allocate_blocks,
    bind_kv_caches,
    greedy_generate,
    make_metadata,
    save_tiny_model,
)

BLOCK_SIZE = 4
PROMPTS = [[5, 17, 200, 33, 90, 90, 12, 250, 7, 1, 64, 128, 3], [9, 8, 7, 6, 5, 4, 3], [300, 2, 2, 41]]


def _fused(loaded: LoadedModel) -> Any:
    return loaded.model.model.fused_layers


def _group_metadata(md: AttentionMetadata, groups: int, stride: int) -> AttentionMetadata | list[AttentionMetadata]:
    """A step's metadata for each of `groups` KV cache groups: group g's blocks are the step's
    block ids + g * stride (a hybrid model's groups share the layer caches, in disjoint blocks)."""
    if groups == 1:
        return md
    shift = [stride * g for g in range(groups)]
    return [replace(md, slot_mapping=md.slot_mapping + s * md.block_size,
                    block_tables=torch.where(md.block_tables > 0, md.block_tables + s, md.block_tables))
            for s in shift]


def _fused_against_modules(model, fused, md, input_ids, positions, atol: float) -> torch.Tensor:
    """One step module by module, then through the compiled forward: equal within atol; the
    fused hidden states."""
    with forward_context(md):
        fused.enabled = False
        want = model(input_ids, positions)
        fused.enabled = True
        got = model(input_ids, positions)
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    return got


@torch.inference_mode()
def compare_decode_steps(loaded: LoadedModel, num_reqs: int, steps: int, atol: float, groups: int = 1) -> int:
    """Prefill num_reqs prompts, then decode `steps` steps of all of them; at each step run
    the fused forward and the module path on the same inputs and compare. Returns the number
    of fused calls. `groups` KV cache groups: each group's blocks 8 * num_reqs further on."""
    model, fused = loaded.model, _fused(loaded)
    calls = []
    handle = fused.register_forward_hook(lambda *_: calls.append(1))
    reqs = []
    for i in range(num_reqs):
        prompt = PROMPTS[i % len(PROMPTS)] + [i + 20]
        blocks = allocate_blocks(len(prompt) + steps + 1, BLOCK_SIZE, first_block=1 + 8 * i)
        reqs.append(RequestState(list(prompt), blocks))
    try:
        md, input_ids, positions = make_metadata([(r, len(r.token_ids)) for r in reqs], BLOCK_SIZE)
        with forward_context(_group_metadata(md, groups, 8 * num_reqs)):
            hidden = model(input_ids, positions)
        last = torch.tensor(md.query_start_loc[1:]) - 1
        next_ids = model.compute_logits(hidden[last]).argmax(-1).tolist()
        for r in reqs:
            r.num_computed_tokens = len(r.token_ids)
        for _ in range(steps):
            for r, t in zip(reqs, next_ids):
                r.token_ids.append(int(t))
            md, input_ids, positions = make_metadata([(r, 1) for r in reqs], BLOCK_SIZE)
            md = _group_metadata(md, groups, 8 * num_reqs)
            got = _fused_against_modules(model, fused, md, input_ids, positions, atol)
            next_ids = model.compute_logits(got).argmax(-1).tolist()
            for r in reqs:
                r.num_computed_tokens += 1
    finally:
        handle.remove()
        fused.enabled = True
    return len(calls)


# Verification steps, one per line: per request (query rows, rows kept). A run of q rows is the
# request's next token and q - 1 drafts; the rows not kept are rejected drafts, whose K/V the
# next step's run overwrites (as in speculative decoding); (1, 1) is a decode. The prompts
# leave 14, 8 and 5 tokens computed (block size 4): the first step's runs of 5 start mid-block
# (positions 14..18) and at a block start ending on the next block's start (8..12).
VERIFY_STEPS = [
    [(5, 2), (5, 5), (1, 1)],
    [(5, 5), (3, 1), (2, 2)],
    [(1, 1), (5, 3), (4, 4)],
    [(2, 1), (1, 1), (5, 5)],
]


@torch.inference_mode()
def compare_verify_steps(loaded: LoadedModel, atol: float, chunk: int = 3, computed: int = 10) -> tuple[int, int]:
    """Prefill three prompts, then run VERIFY_STEPS, fused against the module path on the same
    inputs; a fourth request's prompt chunk of `chunk` tokens after `computed` computed ones
    (prefilled with the three) joins the second step. Returns (fused calls (the prefill is not),
    steps whose longest query run is > 1)."""
    model, fused = loaded.model, _fused(loaded)
    calls = []
    handle = fused.register_forward_hook(lambda *_: calls.append(1))
    reqs = []
    for i in range(3):
        prompt = PROMPTS[i] + [i + 20]
        reqs.append(RequestState(list(prompt), allocate_blocks(len(prompt) + 24, BLOCK_SIZE, first_block=1 + 12 * i)))
    chunked = RequestState(list(range(40, 40 + computed + chunk)), allocate_blocks(40, BLOCK_SIZE, first_block=37))
    runs = 0
    try:
        prefill = [(r, len(r.token_ids)) for r in reqs] + ([(chunked, computed)] if computed else [])
        md, input_ids, positions = make_metadata(prefill, BLOCK_SIZE)
        with forward_context(md):
            model(input_ids, positions)
        for r in reqs:
            r.num_computed_tokens = len(r.token_ids)
        chunked.num_computed_tokens = computed
        for n, step in enumerate(VERIFY_STEPS):
            chunks = []
            for r, (q, _) in zip(reqs, step):
                c = r.num_computed_tokens  # the run: its next token, then q - 1 drafts
                r.token_ids = r.token_ids[:c] + [(7 * (c + j) + 3 * q) % 300 + 1 for j in range(q)]
                chunks.append((r, q))
            if n == 1:
                chunks.append((chunked, chunk))
            chunks.sort(key=lambda item: item[1] != 1)  # decodes first, as the runner orders them
            md, input_ids, positions = make_metadata(chunks, BLOCK_SIZE)
            runs += md.longest_query_run > 1
            _fused_against_modules(model, fused, md, input_ids, positions, atol)
            for r, (_, kept) in zip(reqs, step):
                r.num_computed_tokens += kept
            chunked.num_computed_tokens += chunk if n == 1 else 0
    finally:
        handle.remove()
        fused.enabled = True
    return len(calls), runs


@pytest.fixture(scope="module", params=["llama", "llama-tied-bias", "mistral-window", "qwen2"])
def tiny_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_model(path, tiny_config(request.param))
    return path


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("num_reqs", [1, 2, 3, 6, 11, 23])
def test_fused_decode_matches_module_path(tiny_dir: Path, quantization: str, num_reqs: int) -> None:
    # Quantized weights: the same kernels in both paths, the same floats (exact: rows <= 2 take
    # int16 activations, where one float32 ulp of difference upstream can move a rounding
    # step and the output by ~1e-4; 23 rows take the dequantized panels). Float32 weights:
    # another summation order than torch's GEMM.
    loaded = load_model(str(tiny_dir), quantization=quantization)
    bind_kv_caches(loaded.model, num_blocks=8 * num_reqs + 1, block_size=BLOCK_SIZE)
    atol = 2e-5 if quantization == "none" else 0.0
    assert compare_decode_steps(loaded, num_reqs, steps=5, atol=atol) == 5


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_fused_verification_matches_module_path(tiny_dir: Path, quantization: str) -> None:
    # Decodes and verification runs of mixed lengths (GQA: 4 query heads over 2 KV heads;
    # mistral-window: a 6-token sliding window the runs reach past), and a prompt's last chunk
    # of 3 tokens: every step fused. Quantized weights: the same kernels, the same floats (both
    # paths' attention decodes each row of a run over its own context, models/fused_decode.py).
    loaded = load_model(str(tiny_dir), quantization=quantization)
    atol = 2e-5 if quantization == "none" else 0.0
    steps = len(VERIFY_STEPS)
    bind_kv_caches(loaded.model, num_blocks=48, block_size=BLOCK_SIZE)
    assert compare_verify_steps(loaded, atol) == (steps, steps)
    # A chunk longer than the fused runs (KERNEL_MAX_QUERY_RUN), or a first prompt chunk: that
    # step runs the modules (and agrees: both runs are the module path), the others fused.
    for chunk, computed in ((KERNEL_MAX_QUERY_RUN + 1, 10), (3, 0)):
        bind_kv_caches(loaded.model, num_blocks=48, block_size=BLOCK_SIZE)
        assert compare_verify_steps(loaded, atol, chunk, computed) == (steps - 1, steps)


def test_fused_decode_falls_back_where_it_does_not_apply(tiny_dir: Path) -> None:
    loaded = load_model(str(tiny_dir))
    fused = _fused(loaded)
    bind_kv_caches(loaded.model, num_blocks=8 * FUSED_MAX_ROWS + 9, block_size=BLOCK_SIZE)
    # More rows than the fused range: every step runs module by module, and still agrees.
    assert compare_decode_steps(loaded, FUSED_MAX_ROWS + 1, steps=2, atol=0) == 0
    # A new KV cache binding is picked up (the fused forward would otherwise write the old one).
    caches = bind_kv_caches(loaded.model, num_blocks=64, block_size=BLOCK_SIZE)
    assert compare_decode_steps(loaded, 2, steps=2, atol=2e-5) == 2
    assert fused._bound_cache is caches[0]
    # bfloat16 runs module by module.
    loaded = load_model(str(tiny_dir), dtype="bfloat16")
    bind_kv_caches(loaded.model, num_blocks=64, block_size=BLOCK_SIZE)
    assert compare_decode_steps(loaded, 2, steps=1, atol=0) == 0


def test_fused_decode_on_vattention_slots(tiny_llama_dir: Path) -> None:
    # The engine end to end: the vattention layout (per-request slots, no block tables)
    # decodes through the fused forward and gives the paged engine's greedy tokens.
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
    outputs = {}
    for backend in ("paged", "vattention"):
        llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, kv_cache_backend=backend,
                  kv_cache_memory_bytes="64MiB", max_num_seqs=4)
        fused = llm.llm_engine.engine_core.runner.model.model.fused_layers
        calls = []
        handle = fused.register_forward_hook(lambda *_: calls.append(1))
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        handle.remove()
        assert len(calls) >= 11, backend  # every decode step after the prefill
        del llm
    assert outputs["vattention"] == outputs["paged"]


class _HalvedMLPLayer(LlamaDecoderLayer):
    """The Llama layer with one op more than its parent declares (the MLP output halved)."""

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = super().forward(positions, hidden_states, residual)
        return 0.5 * hidden_states, residual


def test_an_undeclared_extra_op_runs_module_by_module(tiny_llama_dir: Path) -> None:
    tokens = {}
    for kind in ("plain", "extra-op"):
        loaded = load_model(tiny_llama_dir)
        if kind == "extra-op":
            for layer in loaded.model.model.layers:
                layer.__class__ = _HalvedMLPLayer
        bind_kv_caches(loaded.model, num_blocks=16, block_size=BLOCK_SIZE)
        fused = _fused(loaded)
        calls = []
        handle = fused.register_forward_hook(lambda *_: calls.append(1))
        fused.enabled = True
        tokens[kind] = greedy_generate(loaded.model, PROMPTS[0], 10, block_size=BLOCK_SIZE).token_ids
        handle.remove()
        fused.enabled = False
        module_path = greedy_generate(loaded.model, PROMPTS[0], 10, block_size=BLOCK_SIZE).token_ids
        assert tokens[kind] == module_path, kind
        if kind == "plain":
            assert len(calls) == 9 and fused._unsupported is None  # every decode step
        else:
            assert calls == [] and fused._unsupported == "_HalvedMLPLayer declares no decode layout"
    assert tokens["extra-op"] != tokens["plain"]  # the op changes the output: fused would lose it


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_fused_decode_runs_the_attention_soft_cap(tiny_llama_dir: Path, quantization: str) -> None:
    # A Llama whose attention layers soft-cap their scores at 2.0 (Gemma 2's op on Llama's
    # layout): the declared layout carries the cap, the kernel runs it, and the fused steps
    # agree with the module path (whose decode kernel and torch paths apply it too).
    loaded = load_model(tiny_llama_dir, quantization=quantization)
    for layer in loaded.model.model.layers:
        layer.self_attn.attn.logit_soft_cap = 2.0
    assert declared_layout(loaded.model.model.layers[0]) is not None  # the cap is the layer's own
    bind_kv_caches(loaded.model, num_blocks=8 * 3 + 1, block_size=BLOCK_SIZE)
    atol = 2e-5 if quantization == "none" else 0.0
    assert compare_decode_steps(loaded, 3, steps=4, atol=atol) == 4
    assert _fused(loaded)._unsupported is None
    # Negative control: the cap changes the tokens.
    capped = greedy_generate(loaded.model, PROMPTS[0], 10, block_size=BLOCK_SIZE).token_ids
    for layer in loaded.model.model.layers:
        layer.self_attn.attn.logit_soft_cap = None
    bind_kv_caches(loaded.model, num_blocks=16, block_size=BLOCK_SIZE)
    assert greedy_generate(loaded.model, PROMPTS[0], 10, block_size=BLOCK_SIZE).token_ids != capped


def test_the_kernel_refuses_layouts_it_does_not_run() -> None:
    base = ArchConfig(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
        vocab_size=100, max_position_embeddings=64, norm_eps=1e-6, rope={"rope_type": "default", "rope_theta": 1e4},
    )
    runs = DecodeLayout(replace(base, qkv_bias=True, o_bias=True, mlp_bias=True, qk_norm=True))
    assert kernel_refusal(runs) is None
    gemma = DecodeLayout(replace(base, norm_offset=1.0, norm_placement="sandwich", activation="gelu_pytorch_tanh"))
    assert kernel_refusal(gemma) is None
    refused = {
        "norm_offset": DecodeLayout(replace(base, norm_offset=0.5)),
        "norm_placement": DecodeLayout(replace(base, norm_placement="post")),
        "activation": DecodeLayout(replace(base, activation="gelu")),
        "norm": DecodeLayout(replace(base, norm="layer")),
        "learned positions": DecodeLayout(replace(base, rope=None)),
        "row_deltas": DecodeLayout(base, row_deltas=True),
    }
    for field_name, layout in refused.items():
        assert field_name in (kernel_refusal(layout) or ""), field_name
    # A layer's attention features: the kernel runs a window, a soft-cap and sinks (gpt-oss),
    # refuses bidirectional attention.
    assert attention_refusal(AttentionParams(0.25, sliding_window=4, logit_soft_cap=30.0, sinks=True)) is None
    assert "causal" in (attention_refusal(AttentionParams(0.25, causal=False)) or "")


def test_the_default_model_decodes_fused(default_llm: Any) -> None:
    # SmolLM2 (Llama): every decode step through the compiled forward (the performance path).
    from pagedllm import SamplingParams

    from pagedllm.attention.torch_backend import CompiledBackend

    runner = default_llm.llm_engine.engine_core.runner
    assert type(runner.attn_backend) is CompiledBackend  # the module path's decodes: the kernel too
    fused = runner.model.model.fused_layers
    calls = []
    handle = fused.register_forward_hook(lambda *_: calls.append(1))
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        default_llm.generate(["The capital of France is"], params, use_tqdm=False)
    finally:
        handle.remove()
    assert fused._unsupported is None
    assert len(calls) == 5


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("num_reqs", [1, 3])
def test_fused_decode_runs_gemma3(tmp_path_factory: pytest.TempPathFactory, quantization: str, num_reqs: int) -> None:
    # Gemma 3's layout: sandwich norms by (1 + weight), GELU's tanh form, q/k norms, a rotary
    # base per layer kind, windowed and full layers' K/V in KV cache groups of their own
    # (allocated as the engine does: the groups share the layer caches, in disjoint blocks).
    # Quantized weights: the same kernels and floats as the module path (exact).
    from pagedllm.kv_backends.paged.worker import allocate_kv_caches
    from pagedllm.layers.attention import Attention
    from tests.models.test_gemma3 import tiny_gemma3_config
    from tests.models.utils import save_random_model

    path = tmp_path_factory.mktemp("gemma3-fused")
    config = tiny_gemma3_config(window=8)
    config.vocab_size = 320  # PROMPTS' ids
    save_random_model(path, config)
    loaded = load_model(str(path), quantization=quantization)
    layers = [m for m in loaded.model.modules() if isinstance(m, Attention)]
    groups = 4  # the full layer, and the three windowed ones (one layer slot each)
    allocate_kv_caches(layers, num_blocks=groups * 8 * num_reqs + 1, block_size=BLOCK_SIZE, dtype="float32")
    assert sorted(layer.kv_cache_group for layer in layers) == list(range(groups))
    atol = 2e-5 if quantization == "none" else 0.0
    assert compare_decode_steps(loaded, num_reqs, steps=5, atol=atol, groups=groups) == 5
    assert _fused(loaded)._unsupported is None and _fused(loaded)._num_groups == groups
