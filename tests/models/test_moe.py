"""Mixture of experts (layers/moe.py; models/mixtral.py, qwen2_moe.py, qwen3_moe.py).

- Only the experts some token chose run: with top-2 of 8 and one token exactly two experts'
  projections are called (counted by hooks on every expert's linears, on the real forward).
- Greedy equal to HF transformers in float32 on tiny random checkpoints of each family, with
  steps where some experts get no token (asserted), under DESIGN.md's tie rule extended to
  the router: at a step where some token's k-th and (k+1)-th router probabilities in HF's
  run are within ROUTER_TIE (1e-5) in some layer, the expert choice is a tie, and that step
  and all after it count as near-ties (nothing from there on is compared).
- GGUF (qwen2moe, qwen3moe): llama.cpp's 3-D expert tensors kept quantized, greedy equal to HF
  loading the same file with `gguf_file=`.
The engine path of each case (batched prompts, bf16, the declaration) is test_families.py's.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pagedllm.kernels.linear import clear_weight_caches
from pagedllm.layers.moe import MoEConfig, SparseMoE
from pagedllm.models.loader import load_model
from tests.models.utils import (
    FamilyCase,
    bind_kv_caches,
    convert_with_llama_cpp,
    greedy_generate,
    llama_cpp_dir,
    router_margins,
    save_random_model,
    save_tiny_gguf,
)
from tests.utils import assert_greedy_match, hf_greedy

ROUTER_TIE = 1e-5
NUM_STEPS = 16
VOCAB = 262


def tiny_mixtral_config() -> Any:
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=256,
    )  # fmt: skip


def tiny_qwen2_moe_config(mlp_only_layers: tuple[int, ...] = (1,)) -> Any:
    from transformers import Qwen2MoeConfig

    # Layer 1 dense (mlp_only_layers); top-2 weights not renormalised (the default).
    return Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, mlp_only_layers=list(mlp_only_layers),
        max_position_embeddings=256,
    )  # fmt: skip


def tiny_qwen3_moe_config(sparse_step: int = 1) -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=sparse_step,
        max_position_embeddings=256,
    )  # fmt: skip


CONFIGS = {
    "mixtral": tiny_mixtral_config,
    "qwen2-moe": tiny_qwen2_moe_config,
    "qwen3-moe": tiny_qwen3_moe_config,
    "qwen3-moe-sparse-step": lambda: tiny_qwen3_moe_config(sparse_step=2),
}
FAMILY_CASES = [FamilyCase(name, config, fused=False) for name, config in CONFIGS.items()]


def _expert_calls(moe: SparseMoE) -> tuple[list[int], list[Any]]:
    """Hooks counting, per expert, the calls of its two projections (the only modules that
    read its weights)."""
    calls = [0] * len(moe.experts)
    handles = []
    for e, expert in enumerate(moe.experts):
        for linear in (expert.gate_up_proj, expert.down_proj):
            handles.append(linear.register_forward_hook(lambda *_, e=e: calls.__setitem__(e, calls[e] + 1)))
    return calls, handles


def _random_moe(norm_topk_prob: bool = True) -> SparseMoE:
    torch.manual_seed(0)
    moe = SparseMoE(64, MoEConfig(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=norm_topk_prob))
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(0.2 * torch.randn_like(p))
    clear_weight_caches()  # weights written in place (kernels/linear.py's contract)
    return moe


def _dense_reference(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    # Every expert on every token, weighted by the routing (0 for experts not chosen).
    probs = torch.softmax(x @ moe.gate.weight.T, dim=-1)
    top, ids = probs.topk(moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    weights = torch.zeros_like(probs).scatter(1, ids, top)
    out = torch.zeros_like(x)
    for e, expert in enumerate(moe.experts):
        gate, up = (x @ expert.gate_up_proj.weight.T).chunk(2, dim=-1)
        out += weights[:, e : e + 1] * ((torch.nn.functional.silu(gate) * up) @ expert.down_proj.weight.T)
    return out


def test_one_token_top_2_of_8_reads_exactly_two_experts() -> None:
    moe = _random_moe()
    calls, handles = _expert_calls(moe)
    x = torch.randn(1, 64)
    with torch.inference_mode():
        out = moe(x)
    for h in handles:
        h.remove()
    chosen = set(moe.last_routing.expert_ids[0].tolist())
    assert len(chosen) == 2
    assert [e for e, n in enumerate(calls) if n] == sorted(chosen)
    assert all(calls[e] == 2 for e in chosen)  # gate_up and down once each
    torch.testing.assert_close(out, _dense_reference(moe, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_batch_grouped_by_expert_matches_dense_and_calls_each_active_expert_once(norm_topk_prob: bool) -> None:
    moe = _random_moe(norm_topk_prob)
    calls, _ = _expert_calls(moe)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        out = moe(x)
    routing = moe.last_routing
    active = sorted(set(routing.expert_ids.flatten().tolist()))
    assert [e for e, n in enumerate(calls) if n] == active
    assert all(calls[e] == 2 for e in active)  # one matmul pair per active expert, not per token
    assert routing.counts == [int((routing.expert_ids == e).sum()) for e in range(8)]
    torch.testing.assert_close(out, _dense_reference(moe, x), rtol=1e-5, atol=1e-6)


def hf_greedy_router_ties(hf_model: Any, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and top-2 gaps, the gaps zeroed from the first step at which a
    router's k-th and (k+1)-th probabilities of some token are within ROUTER_TIE."""
    calls: list[int] = []  # per forward call (= generation step): margins recorded before it
    with router_margins(hf_model) as margins:
        handle = hf_model.register_forward_pre_hook(lambda *_: calls.append(len(margins)))
        try:
            tokens, gaps = hf_greedy(hf_model, prompt, steps)
        finally:
            handle.remove()
    # hf_greedy's calls: the prefill (token 0), then one after each token (the last unused).
    assert len(calls) == len(tokens) + 1 and len(margins) >= len(calls)
    bounds = [*calls, len(margins)]
    step_min = [min(float(m.min()) for m in margins[a:b]) for a, b in zip(bounds, bounds[1:])]
    tie = next((s for s, m in enumerate(step_min) if m < ROUTER_TIE), len(gaps))
    return tokens, [g if s < tie else 0.0 for s, g in enumerate(gaps)]


# qwen3-moe-sparse-step runs in test_families.py only (the engine path against HF).
@pytest.fixture(scope="module", params=["mixtral", "qwen2-moe", "qwen3-moe"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Path]:
    path = tmp_path_factory.mktemp(request.param)
    return request.param, save_random_model(path, CONFIGS[request.param]()), path


def test_greedy_matches_hf_with_idle_experts(checkpoint: tuple[str, Any, Path]) -> None:
    name, hf_model, path = checkpoint
    loaded = load_model(str(path))
    model = loaded.model
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    sparse = loaded.model_config.num_layers - (1 if name == "qwen2-moe" else 0)  # its layer 1 is dense
    assert len(moes) == sparse
    counts: list[list[int]] = []
    for moe in moes:
        moe.register_forward_hook(lambda m, *_: counts.append(m.last_routing.counts))
    bind_kv_caches(model, num_blocks=8, block_size=16)
    prompt = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(0, VOCAB, (20,), generator=prompt).tolist()
    with torch.inference_mode():
        ours = greedy_generate(model, prompt_ids, NUM_STEPS).token_ids[len(prompt_ids) :]
    ref, gaps = hf_greedy_router_ties(hf_model, prompt_ids, NUM_STEPS)
    assert_greedy_match(ours, ref, gaps, name)
    # Steps where some expert got no token (every decode step: 2 of 8), and grouped steps
    # where an expert ran over several tokens (the prompt).
    assert any(0 in c for c in counts) and any(max(c) > 1 for c in counts)


def _moe_gguf(
    path: Path, hf_model: Any, arch: str, qtype: str, per_expert: bool = False, expert_qtype: str | None = None
) -> None:
    """The HF model as llama.cpp's converter writes a `qwen2moe` / `qwen3moe` / Mixtral
    (`llama`, Q/K rows permuted) file: experts
    as 3-D `ffn_{gate,up,down}_exps` [E, rows, cols], the router `ffn_gate_inp`, the shared
    expert's `*_shexp` and its gate `ffn_gate_inp_shexp` as a vector."""
    import gguf
    import numpy as np

    from tests.models.utils import save_tiny_tokenizer

    cfg = hf_model.config
    plain: dict[str, torch.Tensor] = {}
    experts: dict[str, np.ndarray] = {}
    for name, t in hf_model.state_dict().items():
        if ".mlp.experts." in name:
            layer = name.split(".")[2]
            w = t.float().numpy()
            if name.endswith("gate_up_proj"):
                gate, up = np.split(w, 2, axis=1)
                experts[f"blk.{layer}.ffn_gate_exps.weight"] = gate
                experts[f"blk.{layer}.ffn_up_exps.weight"] = up
            else:
                experts[f"blk.{layer}.ffn_down_exps.weight"] = w
        elif name.endswith("shared_expert_gate.weight"):
            plain[name] = t[0]  # llama.cpp's [hidden] vector
        else:
            plain[name] = t

    def extra(writer: Any) -> None:
        writer.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):  # a `llama` (Mixtral) file has none
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", 0):
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
        qt = gguf.GGMLQuantizationType[expert_qtype or qtype]
        for gguf_name, w in experts.items():
            if per_expert:  # the early Mixtral files: blk.N.ffn_gate.E.weight, one per expert
                stem = gguf_name.removesuffix("_exps.weight")
                for e in range(w.shape[0]):
                    writer.add_tensor(f"{stem}.{e}.weight", gguf.quants.quantize(np.ascontiguousarray(w[e]), qt), raw_dtype=qt)
                continue
            writer.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(w), qt), raw_dtype=qt)

    fake = SimpleNamespace(config=cfg, state_dict=lambda: plain)
    save_tiny_gguf(path, fake, save_tiny_tokenizer(path.parent / "tok"), qtype=qtype, arch=arch, extra=extra)


@pytest.mark.parametrize(
    ("name", "arch", "qtype", "expert_qtype"),
    [("qwen2-moe", "qwen2moe", "Q8_0", "Q4_1"), ("qwen3-moe", "qwen3moe", "Q4_0", "Q4_0"),
     ("qwen3-moe", "qwen3moe", "Q4_0", "Q5_0")],  # Q5_0 experts: kept as GGUF blocks
)
def test_gguf_kept_quantized_matches_hf_on_the_same_file(
    name: str, arch: str, qtype: str, expert_qtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    from pagedllm.kernels import QuantizedWeight

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "src"
    # Every layer sparse: transformers' GGUF reader does not map a dense layer's ffn_* in a
    # qwen2moe file (released Qwen2-MoE files have none).
    config = tiny_qwen2_moe_config(mlp_only_layers=()) if name == "qwen2-moe" else CONFIGS[name]()
    hf_model = save_random_model(src, config)
    gguf_path = tmp_path / "gguf" / f"tiny-{arch}.gguf"
    gguf_path.parent.mkdir()
    _moe_gguf(gguf_path, hf_model, arch, qtype, expert_qtype=expert_qtype)
    from pagedllm.models.gguf_loader import gguf_quant_types
    from pagedllm.models.loader import resolve_quantization

    assert expert_qtype in gguf_quant_types(str(gguf_path))  # the 3-D expert stacks' type counts
    assert resolve_quantization(None, str(gguf_path)) == "gguf"  # kept quantized by default
    loaded = load_model(str(gguf_path), quantization="gguf")
    cfg = hf_model.config
    moes = [m for m in loaded.model.modules() if isinstance(m, SparseMoE)]
    from pagedllm.kernels.gguf_blocks import GGUFBlocks

    # Expert stacks stay the file's blocks in every type (Q4_0, Q4_1 too: the grouped call's
    # form), stacked for it; the attention's Q4_0 matrices are QuantizedWeight (Q8_0 ones blocks).
    assert moes and all(isinstance(e.gate_up_proj.kept_weights()[0], GGUFBlocks) for m in moes for e in m.experts)
    assert all(isinstance(e.down_proj.kept_weights()[0], GGUFBlocks) for m in moes for e in m.experts)
    assert all(m.expert_stacks is not None and m.expert_stacks.gate_up_type == expert_qtype for m in moes)
    has_quantized = any(isinstance(m.quant, QuantizedWeight) for m in loaded.model.modules() if hasattr(m, "quant"))
    assert has_quantized == (qtype in ("Q4_0", "Q4_1"))
    # transformers' GGUF reader leaves these at its defaults; pass the file's values.
    overrides = {"moe_intermediate_size": cfg.moe_intermediate_size, "mlp_only_layers": cfg.mlp_only_layers}
    if name == "qwen2-moe":
        overrides["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    for key, value in overrides.items():
        assert getattr(loaded.hf_config, key) == value, key  # our converter read them
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, **overrides
    ).eval()
    prompt_ids = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(2)).tolist()
    ref, gaps = hf_greedy_router_ties(reference, prompt_ids, NUM_STEPS)
    # Kept quantized, and dequantized to float32 (the converted cache, --quantization none).
    dequantized = load_model(str(gguf_path), quantization="none")
    assert all(e.gate_up_proj.quant is None for m in dequantized.model.modules() if isinstance(m, SparseMoE) for e in m.experts)
    for label, model in (("gguf", loaded.model), ("dequantized", dequantized.model)):
        bind_kv_caches(model, num_blocks=8, block_size=16)
        with torch.inference_mode():
            ours = greedy_generate(model, prompt_ids, NUM_STEPS).token_ids[len(prompt_ids) :]
        assert_greedy_match(ours, ref, gaps, f"{name} {label}")


def test_random_qwen3_moe_checkpoint_script_loads_and_generates(tmp_path: Path) -> None:
    # benchmarks/random_qwen3_moe.py at a shrunk size (its real one is Qwen3-30B-A3B's).
    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.random_qwen3_moe import write_checkpoint

    small = dict(
        hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=8, num_experts_per_tok=2, vocab_size=300, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    write_checkpoint(str(tmp_path), num_layers=2, overrides=small)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory_bytes="4MiB", max_model_len=256)
    model = llm.llm_engine.engine_core.runner.model
    assert sum(isinstance(m, SparseMoE) for m in model.modules()) == 2
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    # `bench latency` counts the routed experts a decode step reads, not all of them.
    from pagedllm.benchmarks.latency import _expert_weights, _linear_weights, measure_decode

    result, _ = measure_decode(llm, batch_size=2, context_len=8, num_steps=2, seed=0)
    assert result.read_gb_s > 0
    products, nbytes = _expert_weights(model)
    per_expert = 3 * 64 * 32  # gate, up, down
    assert products == 2 * 2 * 2 * per_expert  # 2 layers x 2 tokens x top-2
    assert 2 * 2 * 4 * per_expert <= nbytes <= 2 * 4 * 4 * per_expert  # 2 to 4 distinct experts a layer, float32
    numel, _ = _linear_weights(model)
    assert numel < sum(p.numel() for p in model.parameters()) - 8 * per_expert  # experts not in the dense count


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2-moe", "qwen3-moe"])
def test_tensor_parallel_2_matches_hf(name: str, tmp_path: Path) -> None:
    # Two ranks (mp), each with half of every expert's (and the shared expert's) columns.
    from pagedllm import LLM, SamplingParams
    from tests.utils import TEXT_PROMPTS

    hf_model = save_random_model(tmp_path, CONFIGS[name]())
    llm = LLM(str(tmp_path), tensor_parallel_size=2, dtype="float32", max_model_len=256, kv_cache_memory_bytes="8MiB")
    try:
        model = llm.llm_engine.engine_core.runner.runner.model
        moe = next(m for m in model.modules() if isinstance(m, SparseMoE))
        assert moe.experts[0].gate_up_proj.out_features == hf_model.config.moe_intermediate_size  # 2 * I / 2
        params = SamplingParams(max_tokens=NUM_STEPS, temperature=0.0, ignore_eos=True)
        outs = llm.generate(TEXT_PROMPTS[:3], params, use_tqdm=False)
    finally:
        llm.shutdown()
    for out in outs:
        ref, gaps = hf_greedy_router_ties(hf_model, out.prompt_token_ids, NUM_STEPS)
        assert_greedy_match(out.outputs[0].token_ids, ref, gaps, f"{name} tp=2")


def _quantized_round_trip(hf_model: Any, qtype: str) -> Any:
    """A copy of the HF model holding the weights a GGUF of it written by `_moe_gguf` stores:
    every matrix (and expert stack) through gguf-py's quantize / dequantize, the embedding at
    Q8_0 (save_tiny_gguf's rule), vectors (norms) untouched."""
    import copy

    import gguf

    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() < 2:
                continue
            qt = gguf.GGMLQuantizationType["Q8_0" if "embed" in name else qtype]
            w = param.numpy()
            param.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, qt), qt).reshape(w.shape)))
    return model


@pytest.mark.parametrize("per_expert", [False, True], ids=["stacked", "per-expert"])
def test_mixtral_gguf_as_llama_with_experts(per_expert: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # llama.cpp writes Mixtral as `llama` with expert tensors and llama.expert_count;
    # transformers has no Mixtral GGUF reader, so the reference is HF's Mixtral on the
    # file's weights (quantized and back), and the file is loaded kept quantized.
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    hf_model = save_random_model(tmp_path / "src", CONFIGS["mixtral"]())
    gguf_path = tmp_path / "gguf" / "tiny-mixtral.gguf"
    gguf_path.parent.mkdir()
    _moe_gguf(gguf_path, hf_model, "llama", "Q8_0", per_expert=per_expert)
    loaded = load_model(str(gguf_path), quantization="gguf")
    assert loaded.model_config.architecture == "MixtralForCausalLM"
    moes = [m for m in loaded.model.modules() if isinstance(m, SparseMoE)]
    # Each expert's blocks a view of one stack: of the file's 3-D Q8_0 blocks, or (per-expert
    # tensors, kept as blocks) of the stack finish_loading builds from them.
    assert len(moes) == 2 and all(m.expert_stacks is not None for m in moes)
    assert all(e.gate_up_proj.quant is None and e.gate_up_proj.blocks is not None for m in moes for e in m.experts)
    reference = _quantized_round_trip(hf_model, "Q8_0")
    assert_greedy_matches_router_ties(loaded, reference, "mixtral gguf")


def assert_greedy_matches_router_ties(loaded: Any, reference: Any, label: str) -> None:
    """Our greedy tokens on a fixed random prompt equal HF's `reference` by the tie rule
    extended to the router (hf_greedy_router_ties)."""
    bind_kv_caches(loaded.model, num_blocks=8, block_size=16)
    prompt_ids = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        ours = greedy_generate(loaded.model, prompt_ids, NUM_STEPS).token_ids[len(prompt_ids) :]
    ref, gaps = hf_greedy_router_ties(reference, prompt_ids, NUM_STEPS)
    assert_greedy_match(ours, ref, gaps, label)


@pytest.mark.slow  # the converter's own start (torch, transformers)
@pytest.mark.skipif(llama_cpp_dir() is None, reason="PAGEDLLM_LLAMA_CPP_DIR names no llama.cpp tree")
def test_mixtral_written_by_llama_cpp_converter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # llama.cpp's own converter (F32: the file holds the source's weights exactly) writes the
    # `llama` file with llama.expert_count and 3-D expert stacks; it loads as Mixtral and
    # matches HF's Mixtral on the source directory.
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    hf_model = save_random_model(tmp_path / "src", CONFIGS["mixtral"]())
    path = tmp_path / "gguf" / "tiny-mixtral.gguf"
    path.parent.mkdir()
    convert_with_llama_cpp(tmp_path / "src", path, "f32")
    loaded = load_model(str(path))
    assert loaded.model_config.architecture == "MixtralForCausalLM"
    assert sum(isinstance(m, SparseMoE) for m in loaded.model.modules()) == 2
    assert_greedy_matches_router_ties(loaded, hf_model, "mixtral by llama.cpp's converter")


def test_int4_keeps_the_router_at_8_bits(tmp_path: Path) -> None:
    save_random_model(tmp_path, CONFIGS["qwen3-moe"]())
    loaded = load_model(str(tmp_path), quantization="int4")
    moe = next(m for m in loaded.model.modules() if isinstance(m, SparseMoE))
    assert moe.gate.quant is not None and moe.gate.quant.bits == 8
    assert moe.experts[0].gate_up_proj.quant.bits == moe.experts[0].down_proj.quant.bits == 4


def test_cuda_graphs_refuse_a_moe_model() -> None:
    # A captured graph would replay the experts routed to at capture, whatever the tokens.
    from pagedllm.worker.cuda_graphs import DecodeGraphs, eager_capture

    model = torch.nn.Sequential(_random_moe())
    with pytest.raises(ValueError, match="CUDA graphs cannot capture SparseMoE"):
        DecodeGraphs(model, [1, 2], 16, 16, torch.device("cpu"), eager_capture)
