"""SparseMoE's grouped-expert call (layers/moe.py, kernels/gguf_moe.py) against its own loop:
- GGUF-block experts are stacked at finish_loading, each expert's Linear then holding a view
  of the stacks (no second copy);
- steps of up to 16 tokens take the grouped call (no expert Linear is called), larger ones
  too where the build has the int16 path, up to 128 pairs per expert; past that the loop;
  both agree within 1e-4 of the output's largest magnitude (tests/kernels/test_gguf_moe.py);
- the loop is the path for experts of mixed types, with LoRA slots and without the extension;
- end to end, a small random Qwen3-MoE GGUF (Q8_0, Q4_0, and Q4_K experts with Q6_K down)
  decodes greedy-equal to the loop path (DESIGN.md's tie rule on the loop's logprobs).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from pagedllm.kernels import build
from pagedllm.kernels.gguf_blocks import GGUFBlocks, type_index
from pagedllm.kernels.gguf_moe import GROUPED_MAX_PAIRS_PER_EXPERT
from pagedllm.layers.moe import MoEConfig, SparseMoE
from pagedllm.models.loader import load_model
from tests.kernels.test_gguf_kernels import random_blocks
from tests.models.test_moe import VOCAB, _moe_gguf, tiny_qwen3_moe_config
from tests.models.utils import bind_kv_caches, greedy_generate, save_random_model
from tests.utils import assert_greedy_match

E, H, I = 8, 256, 256


def gguf_moe(gate_up_types: list[str], down_type: str = "Q6_K") -> SparseMoE:
    """A SparseMoE whose experts load GGUF blocks (expert e's gate/up of gate_up_types[e]),
    the router float, finished as the loader finishes a model."""
    torch.manual_seed(0)
    moe = SparseMoE(H, MoEConfig(num_experts=E, top_k=2, intermediate_size=I, norm_topk_prob=True))
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(E, H))
    for e, expert in enumerate(moe.experts):
        for shard in (0, 1):
            blocks = random_blocks(gate_up_types[e], I, H, seed=10 * e + shard)
            expert.gate_up_proj.weight_loader(expert.gate_up_proj.weight, blocks, shard)
        expert.down_proj.weight_loader(expert.down_proj.weight, random_blocks(down_type, H, I, seed=10 * e + 2))
    moe.finish_loading()
    for m in moe.modules():  # the loader's pass (a no-op on the experts by now)
        if m is not moe and hasattr(m, "finish_loading"):
            m.finish_loading()
    return moe


def expert_linear_calls(moe: SparseMoE) -> list[int]:
    calls = [0]
    for expert in moe.experts:
        for linear in (expert.gate_up_proj, expert.down_proj):
            linear.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def run(moe: SparseMoE, x: torch.Tensor, grouped: bool) -> torch.Tensor:
    moe.use_grouped = grouped
    with torch.inference_mode():
        return moe(x)


def test_stacks_are_the_experts_weights_and_the_grouped_call_matches_the_loop() -> None:
    if build.gguf_linear_ops() is None:
        pytest.skip("the gguf_linear extension did not build")
    moe = gguf_moe(["Q4_K"] * E)
    stacks = moe.expert_stacks
    assert stacks is not None and (stacks.gate_up_type, stacks.down_type) == ("Q4_K", "Q6_K")
    assert tuple(stacks.gate_up.shape[:2]) == (E, 2 * I) and tuple(stacks.down.shape[:2]) == (E, H)
    for e, expert in enumerate(moe.experts):  # views of the stacks, not copies
        assert expert.gate_up_proj.blocks.data.data_ptr() == stacks.gate_up[e].data_ptr()
        assert expert.down_proj.blocks.data.data_ptr() == stacks.down[e].data_ptr()
    calls = expert_linear_calls(moe)
    int16 = build.gguf_linear_ops().small_m_kernels()[type_index(build.gguf_linear_ops(), "Q4_K")].startswith("int16")
    for num_tokens in (1, 3, 16, 64):
        x = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(num_tokens))
        grouped = run(moe, x, True)
        # Past 16 tokens only where both types take the int16 path (grouped_experts_available).
        assert (calls[0] == 0) == (num_tokens <= 16 or int16), num_tokens
        loop = run(moe, x, False)
        assert calls[0] > 0
        calls[0] = 0
        assert (grouped - loop).abs().max() <= 1e-4 * loop.abs().max(), num_tokens
    # Past GROUPED_MAX_PAIRS_PER_EXPERT pairs per expert on average: the loop.
    run(moe, torch.randn(GROUPED_MAX_PAIRS_PER_EXPERT * E // moe.top_k + 1, H), True)
    assert calls[0] > 0


@pytest.mark.parametrize("expert_type", ["MXFP4", "Q8_0"])
def test_gpt_oss_experts_biases_and_clamped_swiglu_in_the_grouped_call(expert_type: str) -> None:
    # gpt-oss's experts (biases on every projection, the clamped SwiGLU between them): stacked
    # with their biases, the grouped call matches their loop; activations large enough that the
    # clamps bind (|gate|, |up| past the limit), so a kernel without them would differ.
    if build.gguf_linear_ops() is None:
        pytest.skip("the gguf_linear extension did not build")
    from pagedllm.models.gpt_oss import ClampedSwiGLU, GptOssMoE

    torch.manual_seed(0)
    act = ClampedSwiGLU(1.702, 7.0)
    moe = GptOssMoE(H, MoEConfig(num_experts=E, top_k=4, intermediate_size=I, norm_topk_prob=True), act)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(E, H))
        moe.gate.bias.copy_(torch.randn(E))
    for e, expert in enumerate(moe.experts):
        for shard in (0, 1):
            expert.gate_up_proj.weight_loader(expert.gate_up_proj.weight, random_blocks(expert_type, I, H, seed=10 * e + shard), shard)
            expert.gate_up_proj.weight_loader(expert.gate_up_proj.bias, 4 * torch.randn(I), shard)
        expert.down_proj.weight_loader(expert.down_proj.weight, random_blocks(expert_type, H, I, seed=10 * e + 2))
        expert.down_proj.weight_loader(expert.down_proj.bias, 1000 * torch.randn(H))  # the outputs are ~1e4
    moe.finish_loading()
    stacks = moe.expert_stacks
    assert stacks is not None and stacks.clamped_swiglu == (1.702, 7.0)
    assert stacks.gate_up_bias is not None and tuple(stacks.gate_up_bias.shape) == (E, 2 * I)
    assert stacks.down_bias is not None and tuple(stacks.down_bias.shape) == (E, H)
    for e, expert in enumerate(moe.experts):  # the biases are views of the stacks': one copy
        assert expert.gate_up_proj.bias.data_ptr() == stacks.gate_up_bias[e].data_ptr()
    calls = expert_linear_calls(moe)
    for num_tokens in (1, 5, 16):
        # random_blocks' weights are large: x scaled so gate/up lie around the limit
        x = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(num_tokens)) / 30
        with torch.inference_mode():
            h = moe.experts[0].gate_up_proj(x)
        assert 0.1 < (h.abs() > 7).float().mean() < 0.9  # the clamps bind on some values, not all
        calls[0] = 0
        grouped = run(moe, x, True)
        assert calls[0] == 0
        loop = run(moe, x, False)
        assert calls[0] > 0
        assert (grouped - loop).abs().max() <= 1e-4 * loop.abs().max(), num_tokens
    # Negative control: the same stacks without the clamp are another function.
    # Negative controls: the stacks without the clamp, or without the down bias, compute
    # another function (the check above tells them apart).
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(4)) / 30
    loop = run(moe, x, False)
    for changed in (dataclasses.replace(stacks, clamped_swiglu=(1.702, 1e30)), dataclasses.replace(stacks, down_bias=None)):
        moe.expert_stacks = changed
        assert (run(moe, x, True) - loop).abs().max() > 1e-2 * loop.abs().max()


def test_mixed_expert_types_and_no_extension_run_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    mixed = gguf_moe(["Q4_K"] * (E - 1) + ["Q5_K"])
    assert mixed.expert_stacks is None
    calls = expert_linear_calls(mixed)
    run(mixed, torch.randn(2, H), True)
    assert calls[0] > 0
    moe = gguf_moe(["Q8_0"] * E, down_type="Q8_0")
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(1))
    grouped = run(moe, x, True)
    calls = expert_linear_calls(moe)
    monkeypatch.setattr(build, "_enabled", False)  # compiled kernels off: gguf-py's dequantizer
    without = run(moe, x, True)
    assert calls[0] > 0
    # float32 activations on that path, int16-rounded ones on the grouped call's.
    assert (grouped - without).abs().max() <= 2e-3 * without.abs().max()


def test_lora_slots_on_the_experts_run_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    # LoRAManager gives every decoder-layer Linear slots after loading: their deltas are the
    # Linears' to add, so the grouped call steps aside.
    import pagedllm.layers.linear as linear

    moe = gguf_moe(["Q4_K"] * E)
    deltas = [0]

    def add_lora_delta(slots: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        deltas[0] += 1
        return y

    monkeypatch.setattr(linear, "add_lora_delta", add_lora_delta)
    for expert in moe.experts:
        for m in (expert.gate_up_proj, expert.down_proj):
            m.lora_slots = object()  # type: ignore[assignment]
    run(moe, torch.randn(1, H), True)
    assert deltas[0] == 2 * moe.top_k


def _random_k_quants(quantize: Any) -> Any:
    """gguf-py's quantize, but Q4_K (which gguf-py only dequantizes) as random valid blocks
    with small scales (|w| < 0.1): the test compares two paths over the same file."""

    def fake(w: np.ndarray, qtype: Any) -> np.ndarray:
        if qtype.name != "Q4_K":
            return quantize(w, qtype)
        rows = int(np.prod(w.shape[:-1]))
        data = random_blocks("Q4_K", rows, w.shape[-1], seed=rows).data.numpy().reshape(rows, -1, 144).copy()
        data[:, :, 0:4] = np.array([1e-4, 1e-4], dtype=np.float16).view(np.uint8)  # d, dmin
        return data.reshape(*w.shape[:-1], -1)

    return fake


def _greedy_with_gaps(model: Any, prompt_ids: list[int], steps: int) -> tuple[list[int], list[float]]:
    with torch.inference_mode():
        req = greedy_generate(model, prompt_ids, steps)
    gaps = [float(p.topk(2).values[0] - p.topk(2).values[1]) for p in req.logprobs]
    return req.token_ids[len(prompt_ids) :], gaps


def _tiny_qwen3_moe_gguf(expert_qtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A small random Qwen3-MoE written as llama.cpp's converter would, experts in
    `expert_qtype` (the rest Q8_0), loaded with its blocks kept."""
    if build.gguf_linear_ops() is None:
        pytest.skip("the gguf_linear extension did not build")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    config = tiny_qwen3_moe_config()
    if expert_qtype == "Q4_K":  # 256-element blocks: the experts' widths a multiple of 256
        config.hidden_size, config.moe_intermediate_size, config.head_dim = 256, 256, 64
    hf_model = save_random_model(tmp_path / "src", config)
    path = tmp_path / "gguf" / "tiny-qwen3moe.gguf"
    path.parent.mkdir()
    if expert_qtype == "Q4_K":
        monkeypatch.setattr(gguf.quants, "quantize", _random_k_quants(gguf.quants.quantize))
    _moe_gguf(path, hf_model, "qwen3moe", "Q8_0", expert_qtype=expert_qtype)
    return load_model(str(path), quantization="gguf")


@pytest.mark.parametrize("expert_qtype", ["Q8_0", "Q4_0", "Q4_K"])
def test_random_qwen3_moe_gguf_greedy_equal_to_the_loop(
    expert_qtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The grouped run's decode steps go through the fused decode (its sparse layers: the same
    # grouped call); the loop's run module by module (the fused decode follows SparseMoE._grouped).
    loaded = _tiny_qwen3_moe_gguf(expert_qtype, tmp_path, monkeypatch)
    moes = [m for m in loaded.model.modules() if isinstance(m, SparseMoE)]
    assert moes and all(m.expert_stacks is not None and m.expert_stacks.gate_up_type == expert_qtype for m in moes)
    bind_kv_caches(loaded.model, num_blocks=8, block_size=16)
    prompt_ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    calls = expert_linear_calls(moes[0])
    for m in moes:
        m.use_grouped = False
    ref, gaps = _greedy_with_gaps(loaded.model, prompt_ids, 16)
    assert calls[0] > 0
    for m in moes:
        m.use_grouped = True
    calls[0] = 0
    ours, _ = _greedy_with_gaps(loaded.model, prompt_ids, 16)
    assert calls[0] == 0  # the 12-token prefill and every decode step: the grouped call
    assert_greedy_match(ours, ref, gaps, f"qwen3moe {expert_qtype} grouped vs loop")


@pytest.mark.parametrize("expert_qtype", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("num_reqs", [1, 2])  # (the third of PROMPTS is past this vocabulary)
def test_fused_decode_runs_the_sparse_layers(
    expert_qtype: str, num_reqs: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Decode steps through one compiled call over every layer, sparse MLPs included (router,
    # layer_ops' routing, the grouped call over the same stacks): the module path's floats.
    from tests.models.test_fused_decode import BLOCK_SIZE, compare_decode_steps

    loaded = _tiny_qwen3_moe_gguf(expert_qtype, tmp_path, monkeypatch)
    fused = loaded.model.model.fused_layers
    bind_kv_caches(loaded.model, num_blocks=8 * num_reqs + 1, block_size=BLOCK_SIZE)
    assert compare_decode_steps(loaded, num_reqs, steps=4, atol=0) == 4
    assert fused._unsupported is None and fused._sparse is not None
    # Where the module path's experts take their loop, so does the step (module by module).
    for m in loaded.model.modules():
        if isinstance(m, SparseMoE):
            m.use_grouped = False
    bind_kv_caches(loaded.model, num_blocks=8 * num_reqs + 1, block_size=BLOCK_SIZE)
    assert compare_decode_steps(loaded, num_reqs, steps=2, atol=0) == 0
