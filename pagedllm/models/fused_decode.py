"""Decode steps through one compiled call over every decoder layer, for the layouts it runs.

At decode a step carries a few rows, and a layer's arithmetic on them costs less than the
Python around it (a dozen module calls, views, allocations and the KV write per layer). When
a step is all decodes and speculative verifications (each request a run of at most
`KERNEL_MAX_QUERY_RUN` consecutive query rows) with at most `FUSED_MAX_ROWS` rows in all,
`FusedDecoderLayers` runs the layers in C++ (`kernels/csrc/decode_layers.cpp`) with the
kernels of the per-module path (norms, rotary, attention, the quantized projections), a
vectorised silu or GELU-tanh (its exp within ~2 ulp; the module path's GeluAndMul and
GemmaRMSNorm call the same compiled ops on float32) and, for float32 weights, an AVX2 matrix-vector
kernel at one row and register tiles (csrc/gemm_tiles.h) at more, in place of torch's GEMM:
the results agree with the module path to float32 rounding, exactly for quantized weights
(tests/models/test_fused_decode.py). A projection is passed in its kept form
(`_decode_linear`): float32, `QuantizedWeight` int8/int4, GGUF blocks of any kept type
(`Linear.blocks`: up to small_m_max_rows (16; 64 for int8 K-quants) the gguf_linear small-M kernel, above it rows
decoded to float32 in chunked_gemm's chunks and torch's GEMM, csrc/decode_gguf_linear.h), or
`Linear.sections` of those, each part into its output rows: the module path's floats exactly
(tests/models/test_fused_decode_gguf.py). With `--prefill-activations bf16` a step of at least
BF16_ACTIVATION_MIN_ROWS rows multiplies with the layers' bf16 weight copies through torch's
bf16 GEMM, as the module path does (kernels/bf16_activations.py). A verification run's rows are decoded each as a one-token
decode of its own context (`AttentionMetadata.row_decodes`: the row at position p reads its
request's K/V over [0, p], every row's K/V written first), which is causal attention over the
run; the module path's attention does the same for such steps, with the same kernel.

The compiled forward runs what a layer declares and nothing else. A decoder layer class
declares what its forward computes by defining `decode_layout(self) -> DecodeLayout | None`
in its own class body (the layout is the `ArchConfig` the layer was built from: one description
of the architecture); a subclass that does not define it again (it may have changed what the
layer computes) is not taken to compute its parent's layout, and a layout with a field the
kernel does not run (`kernel_refusal`), or an attention layer with a feature its attention
does not run (`attention_refusal`: bidirectional), is not run. Either way the model goes
module by module.

The layouts it runs: Llama's (pre-norms, silu; q/k norms, biases, windows, soft-caps) and
Gemma 2/3's (sandwich norms by 1 + weight, GELU's tanh form, a rotary table per layer kind);
a hybrid model's KV cache groups each give their layers' slot mapping and block tables;
sparse MLPs whose experts are GGUF stacks (Qwen3-MoE, Mixtral; gpt-oss with its attention
sinks, biased router and experts, softmax over the selected logits and clamped SwiGLU).

Anything else runs the modules too: steps with a first or a longer prompt chunk, more rows, bfloat16,
GGUF blocks of a type the compiled build does not hold (`_gguf_refusal`, by name), tensor
parallelism, an attention backend that does not `runs_fused_decode` (reference, Triton), or `AttentionConfig.fused_decode=False` (`--no-fused-decode`, e.g. to
see the per-module breakdown in `bench latency --profile`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.attention.kernel_args import kernel_args
from pagedllm.attention.layouts import BLOCK_TABLES, KVLayout
from pagedllm.attention.metadata import AttentionMetadata, get_attention_metadata
from pagedllm.attention.params import AttentionParams
from pagedllm.attention.torch_backend import MAX_SHORT_RUN, CompiledBackend
from pagedllm.kernels import decode_layers_ops
from pagedllm.kernels.gemm import CHUNK_ROWS
from pagedllm.kernels.gguf_blocks import GGUFBlocks, small_m_max_rows, small_m_path
from pagedllm.layers.kv_quant import quant_format
from pagedllm.layers.linear import KeptWeight, Linear
from pagedllm.layers.moe import SparseMoE
from pagedllm.lora.layers import active_mapping
from pagedllm.models.family import ArchConfig
from pagedllm.platforms.host import is_host_tensor
from pagedllm.kernels import INT16_MAX_ROWS, PANEL_MAX_ROWS, TILE_MAX_ROWS

logger = logging.getLogger(__name__)

# Up to this many decode rows (the quantized kernels' range: more rows dequantize and GEMM).
FUSED_MAX_ROWS = PANEL_MAX_ROWS

# The longest query run of one request the fused path takes (a decode: 1; verifying k drafts:
# k + 1): the module path's attention sends the same steps to the same kernel (MAX_SHORT_RUN);
# a step with a longer run or a first prompt chunk runs the modules, whose prefill attention
# is a flash kernel.
KERNEL_MAX_QUERY_RUN = MAX_SHORT_RUN

_ENABLED = True  # each instance is set from AttentionConfig.fused_decode by the engine's builder
_EMPTY = torch.empty(0)
_EMPTY_ROWS = torch.empty(0, dtype=torch.int64)


@dataclass(frozen=True)
class DecodeLayout:
    """What one decoder layer computes, as declared by its class (see the module docstring):
    the architecture it was built from (one description: norms, activation, positions,
    biases, q/k norm), plus what the layer itself adds. Each attention layer's own features
    (window, soft-cap, ...) are its AttentionParams, read from the layer."""

    arch: ArchConfig
    row_deltas: bool = False
    """A layer whose own forward adds per-row deltas to its projections' outputs (refused).
    LoRA adapters are not declared here: they live on the Linear layers (lora_slots) and the
    compiled forward adds them itself (_bind_lora, kernels/csrc/lora_delta.h)."""


# HF activation name -> the kernel's (decode_layers.cpp: "silu" or "gelu_tanh").
_KERNEL_ACTIVATION = {"silu": "silu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
# The architecture fields the kernel runs only with these values (biases and q/k norm: any).
# Gemma's (1 + weight) norms run with the kernel's norm_offset 1, its sandwich
# norms as the layer's attn_out_norm / mlp_out_norm, gelu's tanh form as "gelu_tanh".
_KERNEL_RUNS: dict[str, tuple[object, ...]] = {
    "norm": ("rms",),
    "norm_offset": (0.0, 1.0),
    "norm_placement": ("pre", "sandwich"),
    "activation": (*_KERNEL_ACTIVATION, "swiglu_clamped"),  # the latter: sparse layers only (_why_unsupported)
    "gated_mlp": (True,),
    "partial_rotary_factor": (1.0,),
}
# The attention features (AttentionParams.features) the kernel's attention runs: the
# compiled decode kernel's (decode_layers.cpp calls it with the layer's sinks).
_KERNEL_ATTENTION = CompiledBackend.runs


def kernel_refusal(layout: DecodeLayout) -> str | None:
    """Why decode_layers.cpp cannot run this layout, None when it can."""
    for name, values in _KERNEL_RUNS.items():
        if getattr(layout.arch, name) not in values:
            runs = " or ".join(repr(v) for v in values)
            return f"the layout's {name}={getattr(layout.arch, name)!r} (the kernel runs {runs})"
    if layout.arch.rope is None:
        return "the layout's learned positions (the kernel runs a rotary embedding)"
    if layout.row_deltas:
        return "the layout's row_deltas=True (the kernel runs False)"
    return None


def attention_refusal(params: AttentionParams) -> str | None:
    """Why the kernel's attention cannot run a layer with these features, None when it can."""
    for feature in params.features():
        if feature not in _KERNEL_ATTENTION:
            return f"an attention layer's {feature}={getattr(params, feature)!r} (the kernel runs {sorted(_KERNEL_ATTENTION)})"
    return None


def _decodes_and_verifications(md: AttentionMetadata) -> bool:
    """Whether every request of the step is a decode or a run of at most KERNEL_MAX_QUERY_RUN
    rows after a cached context (a verification, or a prompt's short last chunk); a first
    prompt chunk runs the modules."""
    if md.num_decodes == md.num_reqs:
        return True
    if md.longest_query_run > KERNEL_MAX_QUERY_RUN:
        return False
    starts = md.query_start_loc
    return all(end - start < seq_len for start, end, seq_len in zip(starts, starts[1:], md.seq_lens_list))


def declared_layout(layer: nn.Module) -> DecodeLayout | None:
    """The layout the layer's own class declares; None where that class declares none (a
    subclass does not inherit its parent's declaration)."""
    declare = type(layer).__dict__.get("decode_layout")
    return None if declare is None else declare(layer)


def _projections(layer: nn.Module) -> tuple[Linear, ...]:
    """A decoder layer's projections in the compiled forward's order: qkv, o, then a dense MLP's
    gate_up, down, or a sparse MLP's router (its experts are the grouped call's stacks)."""
    attn, mlp = layer.self_attn, layer.mlp
    if isinstance(mlp, SparseMoE):
        return (attn.qkv_proj, attn.o_proj, mlp.gate)
    return (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)


def _sparse_mlp_refusal(layer: nn.Module) -> str | None:
    """Why the compiled forward cannot run this layer's sparse MLP, None when it can: its experts
    are GGUF stacks of one type per projection (the grouped call's), no shared expert, no LoRA
    on the layer."""
    mlp = layer.mlp
    if layer.self_attn.qkv_proj.lora_slots is not None:
        return "LoRA adapters on a sparse MoE model's layers"
    if mlp.expert_stacks is None:
        return "a sparse MLP whose experts are not GGUF blocks of one type per projection (no grouped stacks)"
    if mlp.shared_expert is not None:
        return "a sparse MLP with a shared expert"
    if mlp.experts[0].gate_up_proj.lora_slots is not None:
        return "LoRA adapters on a sparse MLP's experts"
    return None


def _norm_weight(norm: nn.Module) -> torch.Tensor:
    """A norm's weight (the kernel adds the layout's norm_offset: Gemma's 1 + weight)."""
    return norm.weight.detach()


def _layer_norms(layer: nn.Module, arch: ArchConfig) -> tuple[torch.Tensor, ...]:
    """(before attention, before the MLP, after attention, after the MLP): Llama's names
    (input_layernorm, post_attention_layernorm: the norm before its MLP; no sandwich norms), or
    Gemma's sandwich (input_layernorm, pre_feedforward_layernorm; post_attention_layernorm and
    post_feedforward_layernorm on the attention's and the MLP's outputs)."""
    if arch.norm_placement == "sandwich":
        names = ("input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm",
                 "post_feedforward_layernorm")
        return tuple(_norm_weight(getattr(layer, n)) for n in names)
    return (_norm_weight(layer.input_layernorm), _norm_weight(layer.post_attention_layernorm), _EMPTY, _EMPTY)


def _kept_form(
    ops: Any, weight: KeptWeight, bias: torch.Tensor = _EMPTY, bf16: torch.Tensor = _EMPTY, bf16_min_rows: int = 0,
    panel_min_rows: int = 0, decode_activations: str = "int16",
) -> Any:
    """A kept weight (a whole layer's, or one section's: no bias or bf16 copy) as a DecodeLinear;
    GGUF blocks in bf16 panels from panel_min_rows rows up (0: never), their small-M kernel's
    activations as `decode_activations` says (kernels/gguf_blocks.py DECODE_ACTIVATIONS)."""
    if isinstance(weight, GGUFBlocks):
        type_index = ops.gguf_type_names().index(weight.type_name)
        small_rows = small_m_max_rows(weight.type_name, decode_activations)
        return ops.DecodeLinear.gguf(weight.data.contiguous(), type_index, weight.k, small_rows, CHUNK_ROWS,
                                     panel_min_rows, bias, bf16, bf16_min_rows, small_m_path(decode_activations))
    zeros = _EMPTY if weight.zeros is None else weight.zeros
    return ops.DecodeLinear(weight.bits, weight.qweight, weight.scales, zeros, bias, bf16, bf16_min_rows)


def _decode_linear(ops: Any, linear: Linear, bf16_min_rows: int) -> Any:
    """The layer as the compiled forward takes it: float32, int8/int4, GGUF blocks, or
    sections of those (kernels/csrc/decode_layers.cpp's DecodeLinear), with its bias and its
    bf16 copy (--prefill-activations bf16, used from bf16_min_rows rows up; empty without)."""
    bias = _EMPTY if linear.bias is None else linear.bias.detach()
    bf16 = _EMPTY if linear.bf16_weight is None else linear.bf16_weight
    panel_min_rows = linear.bf16_panel_rows() or 0  # GGUF blocks' bf16 panels
    if linear.sections is not None:
        parts = [_kept_form(ops, weight, panel_min_rows=panel_min_rows, decode_activations=linear.decode_activations)
                 for _, weight in linear.sections]
        offsets = [offset for offset, _ in linear.sections]
        return ops.DecodeLinear.sections(parts, offsets, bias, bf16, bf16_min_rows)
    kept = linear.quant if linear.quant is not None else linear.blocks
    if kept is None:
        return ops.DecodeLinear(32, linear.weight.detach(), _EMPTY, _EMPTY, bias, bf16, bf16_min_rows)
    return _kept_form(ops, kept, bias, bf16, bf16_min_rows, panel_min_rows, linear.decode_activations)


def _gguf_refusal(ops: Any, linear: Linear) -> str | None:
    """Why the compiled forward cannot run a projection's GGUF blocks (a type its build does
    not hold), None when it can."""
    compiled = set(ops.gguf_type_names())
    for weight in linear.kept_weights():
        if isinstance(weight, GGUFBlocks) and weight.type_name not in compiled:
            return (f"a projection keeps GGUF {weight.type_name} blocks ({linear.extra_repr()}), "
                    "which the compiled layers do not run")
    return None


class FusedDecoderLayers(nn.Module):
    """Every decoder layer of a `LlamaModel` (or of a family built on its modules) as one
    compiled call at decode (see the module docstring). Holds no parameters: it reads the
    layers' own tensors (Llama's module names; q/k norm layouts add self_attn.q_norm and
    self_attn.k_norm), built on first use and rebuilt when the runner binds other KV caches."""

    def __init__(self) -> None:
        super().__init__()
        self.enabled = _ENABLED
        """False runs every step module by module (AttentionConfig.fused_decode)."""
        self._decoder: Any = None
        self._bound_cache: torch.Tensor | None = None  # layer 0's KV cache when built
        self._bound_bf16: torch.Tensor | None = None  # layer 0's qkv bf16 copy when built
        self._bound_panel_rows: int | None = None  # and its bf16 panels' min rows
        self._bound_decode_activations = "int16"  # and its small-M kernel's activations
        self._unsupported: str | None = None  # why this model cannot run fused, once found
        self._layout: KVLayout = BLOCK_TABLES  # the bound attention backend's KV layout
        self._num_groups = 1  # KV cache groups the layers read
        self._sparse: SparseMoE | None = None  # a sparse MLP of the model (its grouped call's bounds)

    def applies(self, layers: nn.ModuleList, hidden_states: torch.Tensor) -> bool:
        """Whether this step (its rows in hidden_states) can run fused; called every step."""
        rows = hidden_states.shape[0]
        if not self.enabled or self._unsupported is not None or not 0 < rows <= FUSED_MAX_ROWS:
            return False
        if not is_host_tensor(hidden_states) or hidden_states.dtype != torch.float32:
            return False  # a host kernel: a device runs module by module (the Triton kernels)
        backend = layers[0].self_attn.attn.backend
        if backend is None or not backend.runs_fused_decode:
            return False
        self._layout = backend.layout
        md = get_attention_metadata(0)
        if not isinstance(md, AttentionMetadata) or not _decodes_and_verifications(md):
            return False
        first = layers[0].self_attn
        if (self._decoder is None or first.attn.kv_cache is not self._bound_cache
                or first.qkv_proj.bf16_weight is not self._bound_bf16
                or first.qkv_proj.bf16_panel_rows() != self._bound_panel_rows  # set_prefill_activations
                or first.qkv_proj.decode_activations != self._bound_decode_activations):
            self._build(layers)
        if self._sparse is not None and not self._sparse._grouped(hidden_states):
            return False  # the module path's experts run their loop (more rows, bf16 copies): so do these
        return self._decoder is not None

    def _build(self, layers: nn.ModuleList) -> None:
        self._decoder = None
        reason = self._why_unsupported(layers)
        ops = decode_layers_ops() if reason is None else None
        if reason is None and ops is None:
            reason = "the compiled extension is unavailable"
        if reason is None:
            refusals = (_gguf_refusal(ops, m) for layer in layers for m in _projections(layer))
            reason = next(filter(None, refusals), None)
        if reason is not None:
            self._unsupported = reason
            logger.info("decode steps run module by module: %s", reason)
            return
        first = layers[0]
        layout = declared_layout(first)
        assert layout is not None
        attn = first.self_attn.attn
        decoder = ops.LlamaDecodeLayers(
            first.input_layernorm.weight.shape[0],
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            layout.arch.intermediate_size,  # the dense MLPs' (a sparse one's experts are stacks)
            float(first.input_layernorm.eps),
            float(attn.scale),
            first.self_attn.rotary_emb.cos_sin_cache,
            float(first.self_attn.q_norm.eps) if layout.arch.qk_norm else 0.0,
            INT16_MAX_ROWS,
            TILE_MAX_ROWS,
            # gpt-oss's clamped SwiGLU is its experts' (set_moe_gpt_oss); no dense MLP runs it
            _KERNEL_ACTIVATION.get(layout.arch.activation, "silu"),
            float(layout.arch.norm_offset),
        )
        shared_rotary = first.self_attn.rotary_emb
        for layer in layers:
            a = layer.self_attn
            modules = _projections(layer)
            # --prefill-activations bf16: the copies are used from the layers' (one) min_rows up.
            bf16_min_rows = max(m.bf16_min_rows for m in modules)
            linears = [_decode_linear(ops, m, bf16_min_rows) for m in modules]
            router = linears.pop() if isinstance(layer.mlp, SparseMoE) else None
            q_norm = _norm_weight(a.q_norm) if layout.arch.qk_norm else _EMPTY
            k_norm = _norm_weight(a.k_norm) if layout.arch.qk_norm else _EMPTY
            before_attn, before_mlp, after_attn, after_mlp = _layer_norms(layer, layout.arch)
            # A layer's own rotary table where it differs from the first layer's (Gemma 3's kinds).
            cos_sin = _EMPTY if a.rotary_emb is shared_rotary else a.rotary_emb.cos_sin_cache
            attn_args = kernel_args(a.attn.params)
            decoder.add_layer(
                before_attn,
                before_mlp,
                q_norm,
                k_norm,
                after_attn,
                after_mlp,
                cos_sin,
                a.attn.kv_cache,
                a.attn.kv_cache_group,
                attn_args.sliding_window, attn_args.soft_cap,
                _EMPTY if a.attn.sinks is None else a.attn.sinks.detach().float().contiguous(),
                linears,
            )
            if router is not None:
                mlp = layer.mlp
                stacks = mlp.expert_stacks
                int8 = mlp.experts[0].gate_up_proj.decode_activations == "int8"  # as SparseMoE.forward
                gate = mlp.gate
                # A float32 router through torch's linear, as the module path's (kernels/linear.py):
                # a last-bit difference in its logits may change the top-k.
                float_router = gate.weight.detach() if not gate.kept_weights() else _EMPTY
                if gate.bias is not None and not stacks.clamped_swiglu:
                    float_router = _EMPTY  # (no family has a biased router but gpt-oss's: DecodeLinear's bias)
                index = decoder.num_layers() - 1
                decoder.set_moe(
                    index, router, float_router, stacks.gate_up, ops.gguf_type_names().index(stacks.gate_up_type),
                    stacks.down, ops.gguf_type_names().index(stacks.down_type), mlp.top_k, mlp.norm_topk_prob, int8,
                )
                if stacks.clamped_swiglu is not None:  # gpt-oss (models/gpt_oss.py's GptOssMoE)
                    router_bias = gate.bias.detach() if float_router.numel() and gate.bias is not None else _EMPTY
                    decoder.set_moe_gpt_oss(index, router_bias, stacks.gate_up_bias, stacks.down_bias,
                                            *stacks.clamped_swiglu)
        self._sparse = next((layer.mlp for layer in layers if isinstance(layer.mlp, SparseMoE)), None)
        self._bind_lora(decoder, layers)
        self._num_groups = 1 + max(layer.self_attn.attn.kv_cache_group for layer in layers)
        self._decoder = decoder
        self._bound_cache = first.self_attn.attn.kv_cache
        self._bound_bf16 = first.self_attn.qkv_proj.bf16_weight
        self._bound_panel_rows = first.self_attn.qkv_proj.bf16_panel_rows()
        self._bound_decode_activations = first.self_attn.qkv_proj.decode_activations

    @staticmethod
    def _bind_lora(decoder: Any, layers: nn.ModuleList) -> None:
        """Hand the layers' LoRA slots (lora/layers.py) to the compiled forward, which adds each
        row's delta after every projection (kernels/csrc/lora_delta.h)."""
        for index, layer in enumerate(layers):
            if isinstance(layer.mlp, SparseMoE):
                continue  # no LoRA on a sparse MoE model's layers (_sparse_mlp_refusal)
            linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
            slots = [m.lora_slots for m in linears]
            if any(s is None for s in slots):
                assert all(s is None for s in slots), "LoRA slots on some projections of a layer only"
                continue
            decoder.set_lora(index, [s.lora_a for s in slots], [s.lora_b for s in slots],
                             [s.section_rows for s in slots], slots[0].max_rank)

    @staticmethod
    def _why_unsupported(layers: nn.ModuleList) -> str | None:
        layouts = [declared_layout(layer) for layer in layers]
        if any(layout is None for layout in layouts):
            names = sorted({type(l).__name__ for l, d in zip(layers, layouts) if d is None})
            return f"{', '.join(names)} declares no decode layout"
        if any(layout != layouts[0] for layout in layouts):
            return "the layers declare different layouts"
        refusal = kernel_refusal(layouts[0])  # type: ignore[arg-type]
        if refusal is not None:
            return refusal
        for layer in layers:
            a = layer.self_attn
            attn = a.attn
            refusal = attention_refusal(attn.params)
            if refusal is not None:
                return refusal
            if attn.kv_cache is None or not (attn.kv_cache.dtype == torch.float32 or quant_format(attn.kv_cache)):
                return "the KV cache is neither float32 nor 8-bit codes"
            if a.o_proj.tp.size != 1:
                return "tensor parallelism"
            if isinstance(layer.mlp, SparseMoE) and (refusal := _sparse_mlp_refusal(layer)) is not None:
                return refusal
            clamped = isinstance(layer.mlp, SparseMoE) and layer.mlp.expert_stacks is not None and (
                layer.mlp.expert_stacks.clamped_swiglu is not None)
            if clamped != (layouts[0].arch.activation == "swiglu_clamped"):  # type: ignore[union-attr]
                return "an MLP whose activation the kernel does not pair with its layout (clamped SwiGLU)"
            if layer.input_layernorm.weight.dtype != torch.float32:
                return "the model is not float32"
            if a.rotary_emb.cos_sin_cache.dtype != torch.float32:
                return "the rotary table is not float32"
            for m in _projections(layer):
                if not m.kept_weights() and m.weight.dtype != torch.float32:
                    return "the weights are neither float32 nor quantized"
        return None

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # hidden_states: [M, hidden] embeddings -> (h, residual) after the last layer
        # Each row a decode of its own context (a verification run's rows: causal attention).
        # Per KV cache group (a hybrid model's windowed and full layers) its slot mapping and
        # block tables; the groups' steps are otherwise the same.
        mds = [get_attention_metadata(g).row_decodes for g in range(self._num_groups)]
        md = mds[0]
        rows = hidden_states.shape[0]
        slots = self._layout.kernel_slots(md, rows)  # empty: the block tables address the cache
        lora = active_mapping()
        self._decoder.set_lora_rows(_EMPTY_ROWS if lora is None else lora.row_slots[:rows])
        h, residual = self._decoder.forward(
            hidden_states, _EMPTY, positions, [m.slot_mapping for m in mds], [m.block_tables for m in mds],
            md.seq_lens[:rows], slots,
        )
        return h, residual
