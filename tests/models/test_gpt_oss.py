"""gpt-oss (models/gpt_oss.py) against HF transformers' GptOssForCausalLM, float32.

- YaRN's rotary table (layers/rotary.py) equals HF's inv_freq and attention scaling.
- Greedy equal to HF (DESIGN.md's tie rule, with test_moe.py's router-tie extension) on a tiny
  random checkpoint whose sinks are large enough to matter, with a prompt longer than the
  sliding window, prefilled at once and in chunks (continuation chunks read the cache).
- The sinks matter: with them zeroed our output differs from HF's with them, and equals HF's
  with them zeroed (so the tests here would catch a backend that ignored them).
- The engine on both KV backends (the paged one's decodes through the compiled kernel, which
  runs sinks) against HF.
The engine path (LLM, scheduler, bf16) is test_families.py's, from FAMILY_CASES.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm.attention.torch_backend import CompiledBackend
from pagedllm.kernels import paged_attention_ops
from pagedllm.layers.attention import Attention
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.gpt_oss import GptOssMoE
from pagedllm.models.loader import load_model
from tests.models.test_moe import hf_greedy_router_ties
from tests.models.utils import FamilyCase, bind_kv_caches, greedy_generate, save_random_model
from tests.utils import assert_greedy_match

VOCAB = 262
NUM_STEPS = 16
WINDOW = 8


def tiny_gpt_oss_config() -> Any:
    from transformers import GptOssConfig

    # Layer 0 sliding (window 8), layer 1 full (transformers' default alternation); YaRN as
    # gpt-oss ships it (factor 32 over 4096 original positions), on head_dim 16.
    return GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=256,
    )  # fmt: skip


# bf16: HF's own bf16 logits are up to 0.46 from its float32 ones on this checkpoint (YaRN's
# attention factor 1.35 scales every score by 1.8; sinks and biases everywhere); ours were
# within 0.34 of HF's bf16 (6.2 ulps; the Llama case measures 0.13) and no further from
# float32 than HF's bf16 run (test_families.py's second bound), so 8 ulps here.
FAMILY_CASES = [FamilyCase("gpt-oss", tiny_gpt_oss_config, fused=False, bf16_ulps=8)]


@pytest.mark.parametrize("truncate", [True, False])
@pytest.mark.parametrize("attention_factor", [None, 1.25])
def test_yarn_table_matches_hf(truncate: bool, attention_factor: float | None) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = tiny_gpt_oss_config()
    config.rope_parameters = {**config.rope_parameters, "truncate": truncate, "attention_factor": attention_factor}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](config)
    params = dict(config.rope_parameters)
    ours = RotaryEmbedding(16, 64, params)
    freqs = torch.outer(torch.arange(64, dtype=torch.float32), inv_freq)
    expected = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * scaling
    torch.testing.assert_close(ours.cos_sin_cache, expected, rtol=1e-6, atol=1e-6)
    assert scaling != 1.0  # the attention factor is exercised


def _with_large_sinks(path: Path) -> Any:
    """A random checkpoint whose sinks are N(1, 1) (HF initialises them near 0, where they
    barely change the output) saved again, and its HF model."""
    hf_model = save_random_model(path, tiny_gpt_oss_config())
    with torch.no_grad():
        for layer in hf_model.model.layers:
            layer.self_attn.sinks.copy_(1 + torch.randn_like(layer.self_attn.sinks))
    hf_model.save_pretrained(str(path))
    return hf_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    path = tmp_path_factory.mktemp("gpt-oss")
    return _with_large_sinks(path), path


PROMPT = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(1)).tolist()


def _ours(path: Path, prefill_chunk: int | None = None, zero_sinks: bool = False) -> list[int]:
    model = load_model(str(path)).model
    if zero_sinks:
        for attn in (m for m in model.modules() if isinstance(m, Attention)):
            assert attn.sinks is not None
            attn.sinks.data.zero_()
    bind_kv_caches(model, num_blocks=8, block_size=16)
    with torch.inference_mode():
        return greedy_generate(model, PROMPT, NUM_STEPS, prefill_chunk=prefill_chunk).token_ids[len(PROMPT) :]


@pytest.mark.parametrize("prefill_chunk", [None, 7])
def test_greedy_matches_hf(checkpoint: tuple[Any, Path], prefill_chunk: int | None) -> None:
    hf_model, path = checkpoint
    assert len(PROMPT) > WINDOW  # the sliding layer's window cuts the context
    ref, gaps = hf_greedy_router_ties(hf_model, PROMPT, NUM_STEPS)
    assert_greedy_match(_ours(path, prefill_chunk), ref, gaps, f"gpt-oss chunk={prefill_chunk}")


def test_sinks_change_the_output(checkpoint: tuple[Any, Path]) -> None:
    hf_model, path = checkpoint
    ref, _ = hf_greedy_router_ties(hf_model, PROMPT, NUM_STEPS)
    without = _ours(path, zero_sinks=True)
    assert without != ref
    saved = [layer.self_attn.sinks.detach().clone() for layer in hf_model.model.layers]
    try:
        with torch.no_grad():
            for layer in hf_model.model.layers:
                layer.self_attn.sinks.zero_()
        ref_without, gaps = hf_greedy_router_ties(hf_model, PROMPT, NUM_STEPS)
    finally:
        with torch.no_grad():
            for layer, sinks in zip(hf_model.model.layers, saved):
                layer.self_attn.sinks.copy_(sinks)
    assert_greedy_match(without, ref_without, gaps, "gpt-oss, sinks zeroed")


@pytest.mark.parametrize("kv_cache_backend", ["paged", "vattention"])
def test_engine_greedy_matches_hf_on_both_kv_backends(checkpoint: tuple[Any, Path], kv_cache_backend: str) -> None:
    # Two prompts batched (decodes of both in one step), prefill chunks of 8 tokens (a
    # continuation chunk reads the cache through the window), on each KV backend's layout.
    from pagedllm import LLM, SamplingParams

    hf_model, path = checkpoint
    prompts = [PROMPT, PROMPT[5:] + PROMPT[:3]]
    llm = LLM(
        str(path), dtype="float32", kv_cache_memory_bytes="8MiB", kv_cache_backend=kv_cache_backend,
        max_num_batched_tokens=8, max_num_seqs=2,
    )
    backend = llm.llm_engine.engine_core.runner.model.model.layers[0].self_attn.attn.backend
    if paged_attention_ops() is not None:  # decodes through the C++ kernel (both layouts)
        assert isinstance(backend, CompiledBackend), backend.name
    params = SamplingParams(max_tokens=NUM_STEPS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref, gaps = hf_greedy_router_ties(hf_model, prompt, NUM_STEPS)
        assert_greedy_match(list(out.outputs[0].token_ids), ref, gaps, f"gpt-oss {kv_cache_backend}")



FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, R, K] float -> OpenAI's (blocks [E, R, K / 32, 16] uint8, scales [E, R, K / 32]
    uint8): per 32 elements an exponent so the largest fits 6, each element the nearest e2m1."""
    g = w.reshape(*w.shape[:-1], -1, 32)
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)  # [E, R, G]
    codes = (g / torch.exp2(exp).unsqueeze(-1)).unsqueeze(-1).sub(FP4).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def test_mxfp4_experts_kept_and_greedy_equal_to_hf(tmp_path: Path) -> None:
    # The released checkpoints' form: experts as MXFP4 `_blocks` / `_scales` (written here from
    # the random float weights), kept as ggml MXFP4 blocks; the reference is HF's float model
    # holding transformers' own dequantization of the same tensors.
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from pagedllm.kernels import GGUFBlocks

    hf_model = _with_large_sinks(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _to_mxfp4(state.pop(name).transpose(1, 2))  # rows [out, in]
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        param = hf_model.get_parameter(name)
        with torch.no_grad():
            param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = load_model(str(tmp_path)).model
    experts = [e for m in model.modules() if isinstance(m, GptOssMoE) for e in m.experts]
    assert experts and all(isinstance(e.gate_up_proj.blocks, GGUFBlocks) for e in experts)
    assert all(e.down_proj.blocks is not None and e.down_proj.blocks.type_name == "MXFP4" for e in experts)
    from pagedllm.kernels import build

    if build.gguf_linear_ops() is not None:  # the steps take the grouped call (biases, clamped SwiGLU)
        assert all(m.expert_stacks is not None for m in model.modules() if isinstance(m, GptOssMoE))
    bind_kv_caches(model, num_blocks=8, block_size=16)
    with torch.inference_mode():
        ours = greedy_generate(model, PROMPT, NUM_STEPS).token_ids[len(PROMPT) :]
    ref, gaps = hf_greedy_router_ties(hf_model, PROMPT, NUM_STEPS)
    assert_greedy_match(ours, ref, gaps, "gpt-oss MXFP4")


def test_an_mxfp4_tensor_without_its_pair_is_refused() -> None:
    from pagedllm.models.gpt_oss import gpt_oss_tensors

    blocks = torch.zeros(8, 64, 2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"without their pair: model\.layers\.0\|gate_up_proj"):
        list(gpt_oss_tensors([("model.layers.0.mlp.experts.gate_up_proj_blocks", blocks)]))


def test_compiled_routing_is_top_k_logits_then_softmax_over_them() -> None:
    # route_selected's compiled form (layer_ops' moe_route, softmax_selected: what the fused
    # decode runs) against torch's topk + softmax: the same experts in the same order, weights
    # within float32 rounding; of tied logits the lower expert first (torch's topk leaves the
    # order of ties unspecified).
    from pagedllm.kernels import layer_ops, use_layer_ops
    from pagedllm.models.gpt_oss import route_selected

    logits = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * 3
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1  # a tie at the top
    if not use_layer_ops(logits):
        pytest.skip("the layer_ops extension did not build")
    got = route_selected(logits, 4, torch.float32)
    top, ids = torch.topk(logits, 4, dim=-1)
    assert torch.equal(got.expert_ids[1:], ids[1:]) and got.expert_ids[0].tolist() == [5, 9, *ids[0, 2:].tolist()]
    torch.testing.assert_close(got.weights, torch.softmax(top, dim=-1), atol=1e-6, rtol=0)
    assert got.counts == torch.bincount(ids.flatten(), minlength=32).tolist()
    ids_all, _ = layer_ops().moe_route(logits, 4, True, False)  # selection by probabilities: same ids
    assert torch.equal(ids_all, got.expert_ids)
