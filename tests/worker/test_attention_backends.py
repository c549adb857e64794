"""The attention registry's choice, the backends' refusals by name, and the features only
some backends run (sinks, bidirectional attention) against the float64 reference."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.layouts import BLOCK_TABLES, CONTIGUOUS_SLOTS
from pagedllm.attention.metadata import forward_context
from pagedllm.attention.params import AttentionParams
from pagedllm.attention.registry import bind_backend, select_backend
from pagedllm.attention.torch_backend import CompiledBackend, TorchBackend
from pagedllm.config import AttentionConfig
from pagedllm.kernels import paged_attention_ops
from pagedllm.layers.attention import Attention
from tests.worker.test_attention_paths import D, GROUP, HKV, PATHS, SCALE, _block_ids, _step, _worker

PLAIN = AttentionParams(SCALE)
SINKS = AttentionParams(SCALE, sinks=True)
BIDIRECTIONAL = AttentionParams(SCALE, causal=False)


def test_the_registry_picks_the_compiled_decode_where_it_runs() -> None:
    assert paged_attention_ops() is not None, "the compiled decode kernels must build here"
    default = AttentionConfig()
    assert type(select_backend(default, BLOCK_TABLES, "cpu", [PLAIN])) is CompiledBackend
    assert type(select_backend(default, CONTIGUOUS_SLOTS, "cpu", [PLAIN])) is CompiledBackend
    off = AttentionConfig(compiled_kernels=False)
    assert type(select_backend(off, BLOCK_TABLES, "cpu", [PLAIN])) is TorchBackend
    per_request = AttentionConfig(contiguous_decode="torch")
    assert type(select_backend(per_request, CONTIGUOUS_SLOTS, "cpu", [PLAIN])) is TorchBackend
    assert type(select_backend(per_request, BLOCK_TABLES, "cpu", [PLAIN])) is CompiledBackend
    # The model's needs: the kernel runs sinks (gpt-oss), not bidirectional layers.
    assert type(select_backend(default, BLOCK_TABLES, "cpu", [PLAIN, SINKS])) is CompiledBackend
    assert type(select_backend(default, BLOCK_TABLES, "cpu", [PLAIN, BIDIRECTIONAL])) is TorchBackend


def test_backends_refuse_features_by_name() -> None:
    compiled = select_backend(AttentionConfig(), BLOCK_TABLES, "cpu", [PLAIN])
    with pytest.raises(ValueError, match=r"'torch \(compiled kernels\)'.*causal=False"):
        compiled.check(BIDIRECTIONAL)
    with pytest.raises(ValueError, match="'triton'.*sinks=True"):
        select_backend(AttentionConfig(backend="triton"), BLOCK_TABLES, "cpu", [SINKS])
    with pytest.raises(ValueError, match="'triton' reads block tables; the contiguous slots layout"):
        select_backend(AttentionConfig(backend="triton"), CONTIGUOUS_SLOTS, "cpu", [PLAIN])
    # A layer changed after binding is checked against its backend too.
    layer = Attention(HKV * GROUP, D, HKV, SCALE)
    layer.backend = compiled
    layer.logit_soft_cap = 2.0  # runs
    with pytest.raises(ValueError, match="causal=False"):
        layer.params = BIDIRECTIONAL


def _run(layer: Attention, backend: str, configs: dict[str, AttentionConfig], computed, counts):
    """The layer's output per configuration over one step (context K/V written first)."""
    worker = _worker(backend, layer)
    block_ids = _block_ids(backend, [c + n for c, n in zip(computed, counts)])
    for i, c in enumerate(computed):
        if c:
            md = worker.attention_metadata([block_ids[i]], _step([0], [c]))
            with forward_context(md):
                bind_backend([layer], AttentionConfig(backend="reference"), worker.layout, "cpu")
                layer(torch.randn(c, HKV * GROUP * D), torch.randn(c, HKV * D), torch.randn(c, HKV * D))
    md = worker.attention_metadata(block_ids, _step(computed, counts))
    q, k, v = torch.randn(sum(counts), HKV * GROUP * D), torch.randn(sum(counts), HKV * D), torch.randn(sum(counts), HKV * D)
    outs = {}
    for name, config in configs.items():
        bind_backend([layer], config, worker.layout, "cpu")
        with forward_context(md):
            outs[name] = layer(q, k, v)
    return outs


TORCH_AND_REFERENCE = {"torch": AttentionConfig(), "reference": AttentionConfig(backend="reference")}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("backend", ["paged", "vattention"])
def test_sinks_match_reference(backend: str, path: str) -> None:
    torch.manual_seed(0)
    layer = Attention(HKV * GROUP, D, HKV, SCALE, sliding_window=5, sinks=True)
    layer.sinks.copy_(torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0, 1.0]))  # [H]; 3.0 takes most weight
    # The default (decodes and short runs through the compiled kernel) and torch ops alone.
    configs = {**TORCH_AND_REFERENCE, "torch ops": AttentionConfig(compiled_kernels=False)}
    outs = _run(layer, backend, configs, *PATHS[path])
    assert type(select_backend(AttentionConfig(), BLOCK_TABLES, "cpu", [layer.params])) is CompiledBackend
    torch.testing.assert_close(outs["torch"], outs["reference"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs["torch ops"], outs["reference"], atol=1e-5, rtol=1e-5)
    # Negative control: the same step with the sinks at -inf (no weight) differs.
    layer.sinks.fill_(-float("inf"))
    torch.manual_seed(0)
    without = _run(layer, backend, {"reference": AttentionConfig(backend="reference")}, *PATHS[path])
    assert (without["reference"] - outs["reference"]).abs().max() > 1e-2


@pytest.mark.parametrize("backend", ["paged", "vattention"])
def test_bidirectional_prompts_match_reference(backend: str) -> None:
    torch.manual_seed(0)
    layer = Attention(HKV * GROUP, D, HKV, SCALE, causal=False)
    computed, counts = PATHS["first_chunk"]
    outs = _run(layer, backend, TORCH_AND_REFERENCE, computed, counts)
    torch.testing.assert_close(outs["torch"], outs["reference"], atol=1e-5, rtol=1e-5)
    # Negative control: the first token sees the whole prompt, not itself alone.
    first = outs["reference"][0].view(HKV * GROUP, D)
    torch.manual_seed(0)
    causal = _run(Attention(HKV * GROUP, D, HKV, SCALE), backend, TORCH_AND_REFERENCE, computed, counts)
    assert (causal["reference"][0].view(HKV * GROUP, D) - first).abs().max() > 1e-2
    # A continuation chunk has no bidirectional meaning: refused at the step.
    with pytest.raises(ValueError, match="causal=False runs prompt-only steps"):
        _run(layer, backend, {"torch": AttentionConfig()}, *PATHS["continuation"])


def test_head_bias_is_a_sink_shift_in_the_reference() -> None:
    # A constant b_h on every score of head h against a sink s_h: softmax([scores + b, s])
    # equals softmax([scores, s - b]), so the biased reference must equal the unbiased one
    # with shifted sinks; without sinks the bias cancels. Torch-family backends refuse it.
    from dataclasses import replace

    bias = (1.5, -2.0, 0.0, 3.0, 0.5, -1.0)
    sinks = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0, 1.0])
    reference = {"reference": AttentionConfig(backend="reference")}
    path = PATHS["spec_verify"]
    layer = Attention(HKV * GROUP, D, HKV, SCALE, sinks=True)
    layer.sinks.copy_(sinks - torch.tensor(bias))
    torch.manual_seed(0)
    shifted = _run(layer, "paged", reference, *path)["reference"]
    layer.params = replace(layer.params, head_bias=bias)
    layer.sinks.copy_(sinks)
    torch.manual_seed(0)
    biased = _run(layer, "paged", reference, *path)["reference"]
    torch.testing.assert_close(biased, shifted, atol=1e-5, rtol=1e-5)
    torch.manual_seed(0)
    layer.params = replace(layer.params, head_bias=None)
    assert (_run(layer, "paged", reference, *path)["reference"] - biased).abs().max() > 1e-2
    with pytest.raises(ValueError, match=r"'torch'.*head_bias"):
        select_backend(AttentionConfig(compiled_kernels=False), BLOCK_TABLES, "cpu", [AttentionParams(SCALE, head_bias=bias)])
