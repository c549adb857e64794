"""A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): route, group, compute
only the experts some token chose.

Per step, over the whole flat batch of T tokens:
1. router: logits = x W_gate^T ([T, E]), softmax in float32, top-k per token (HF's order:
   softmax over all E, then top-k, then renormalise the k weights when `norm_topk_prob`);
2. grouping: the T * k (token, expert) pairs sorted by expert id (a stable argsort), with the
   number of pairs per expert (bincount), so each expert's tokens are one contiguous run;
3. one gate/up matmul (fused), silu-and-mul and one down matmul per *active* expert over its
   run of tokens, each row scaled by its routing weight and scatter-added into the output.
An expert no token chose is never called: its weights are not read.

Each expert is an `ExpertMLP` of the shared linear layers, so float, int8/int4
(--quantization) and GGUF-quantized expert weights (2-D slices of llama.cpp's 3-D
`ffn_*_exps` tensors) all run through `Linear.forward`'s kernels, as dense MLPs do.

The grouped call: where every expert's gate/up weights are GGUF blocks of one type and its
down weights of one type (a GGUF file's experts, kept), `finish_loading` stacks them
(kernels/gguf_moe.py's `ExpertStacks`, the experts' linears then holding views of the stacks),
and steps run steps 2-3 in one compiled call over all active experts (csrc/gguf_moe.h:
activations rounded once, threads over (expert, row block) items, results weighted and summed
inside; gpt-oss's experts with their biases and clamped SwiGLU, models/gpt_oss.py): up to 16 tokens on every build, prefill chunks too where the build has the int16 path
(`grouped_experts_available`: up to 128 pairs per expert on average). The loop above stays the
path for larger steps, other weight forms, LoRA, tensor parallelism and builds without the
extension.

Tensor parallelism: over each expert's intermediate columns (like a dense MLP). Every rank
routes all tokens (the router is replicated), holds 1/size of every expert's gate/up rows and
down columns, and sums its partial outputs over all experts (and the shared expert) before a
single all-reduce per layer. Over-experts (expert parallelism) would balance worse on a small
batch and need an all-to-all; per-column reuses the dense layers' sharding as is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.distributed.parallel_state import current_tp
from pagedllm.kernels import (
    ExpertStacks,
    GGUFBlocks,
    grouped_experts,
    grouped_experts_available,
    layer_ops,
    stack_expert_blocks,
    use_layer_ops,
)
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.linear import Linear, MergedLinear, RowParallelLinear


@dataclass(frozen=True)
class MoEConfig:
    """A sparse MLP's shape and routing (models/family.ArchConfig.moe)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    """Of each routed expert."""
    norm_topk_prob: bool
    """Renormalise the top-k weights to sum to one (Mixtral, Qwen3-MoE), else keep the
    softmax probabilities (Qwen2-MoE's default)."""
    shared_expert_intermediate_size: int = 0
    """> 0: a dense expert every token runs, scaled by sigmoid(x W_shared_gate^T) (Qwen2-MoE)."""
    sparse_layers: tuple[bool, ...] = ()
    """Per layer: a sparse MLP (True) or the dense one (`decoder_sparse_step`,
    `mlp_only_layers`); empty: every layer is sparse."""

    def is_sparse(self, layer_idx: int) -> bool:
        return self.sparse_layers[layer_idx] if self.sparse_layers else True


class RouterLinear(Linear):
    """The router's [num_experts, hidden] projection, replicated on every rank; under
    --quantization int4 it is kept at 8 bits (models/loader.py), like the embedding."""


class _PartialDown(RowParallelLinear):
    """A down projection sharded over its input columns like RowParallelLinear, whose
    forward returns this rank's partial sum (the MoE block all-reduces once per layer)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, in_features / size] -> [n, out_features] (partial over ranks)
        return Linear.forward(self, x)


class ExpertMLP(nn.Module):
    """One expert: down(silu(x W_gate^T) * (x W_up^T)), without the all-reduce."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = _PartialDown(intermediate_size, hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, hidden] -> [n, 2 * I / size] -> [n, I / size] -> [n, hidden] (partial)
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


@dataclass
class Routing:
    """The routing of one step (kept as `SparseMoE.last_routing` for tests and counters; small:
    [T, k] per layer)."""

    expert_ids: torch.Tensor
    """[T, k] int64: the chosen experts, best first."""
    weights: torch.Tensor
    """[T, k]: their weights (renormalised or not), in the activations' dtype."""
    counts: list[int]
    """Per expert, the number of tokens routed to it."""


def route(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool, dtype: torch.dtype
) -> Routing:
    """logits: [T, E] -> the top-k experts and weights per token (HF's order: softmax over all
    experts in float32, top-k, optional renormalisation, cast to the activations' dtype). On the
    host the compiled `moe_route` (csrc/layer_ops.h route_row), which the fused decode runs too:
    both paths route alike to the last bit."""
    logits = logits.float()
    if logits.shape[0] and use_layer_ops(logits):
        expert_ids, weights = layer_ops().moe_route(logits, top_k, norm_topk_prob, False)
    else:
        probs = torch.softmax(logits, dim=-1)
        weights, expert_ids = torch.topk(probs, top_k, dim=-1)
        if norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    counts = torch.bincount(expert_ids.flatten(), minlength=logits.shape[-1]).tolist()
    return Routing(expert_ids, weights.to(dtype), counts)


class SparseMoE(nn.Module):
    """The sparse MLP: `gate` (the router), `experts.<e>`, optional `shared_expert` and
    `shared_expert_gate` (HF's Qwen2-MoE names; Mixtral's checkpoint names map onto these)."""

    cuda_graph_safe = False
    """Its forward loops over the experts the step's tokens chose (worker/cuda_graphs.py
    refuses to capture it)."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.tp = current_tp()
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.gate = RouterLinear(hidden_size, moe.num_experts)  # replicated on every rank
        self.experts = nn.ModuleList(
            ExpertMLP(hidden_size, moe.intermediate_size) for _ in range(moe.num_experts)
        )
        self.shared_expert: ExpertMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if moe.shared_expert_intermediate_size > 0:
            self.shared_expert = ExpertMLP(hidden_size, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(hidden_size, 1)
        self.last_routing: Routing | None = None
        self.expert_stacks: ExpertStacks | None = None
        """All experts' GGUF blocks stacked for the grouped call (finish_loading), or None."""
        self.use_grouped = True
        """Run the steps `grouped_experts_available` admits through the grouped call where the
        stacks exist (False: always the loop; tests and benchmarks compare the two)."""

    def finish_loading(self) -> None:
        """Once the experts' linears have joined their shards: stack their weights for the
        grouped call where they are all GGUF blocks, one type per projection, unsharded."""
        for expert in self.experts:
            expert.gate_up_proj.finish_loading()  # idempotent: the loader's later call is a no-op
            expert.down_proj.finish_loading()
        gate_up = [e.gate_up_proj for e in self.experts]
        down = [e.down_proj for e in self.experts]
        linears = gate_up + down
        if self.tp.size > 1 or any(
            not isinstance(m.blocks, GGUFBlocks) or m.bias is not None or m.lora_slots is not None for m in linears
        ):
            return
        try:
            stacks, gu_views, down_views = stack_expert_blocks(
                [m.blocks for m in gate_up], [m.blocks for m in down]  # type: ignore[misc]
            )
        except ValueError:  # mixed types over experts: the loop runs them
            return
        for m, view in zip(gate_up + down, gu_views + down_views):
            m.blocks = view
        self.expert_stacks = stacks

    def _grouped(self, x: torch.Tensor) -> bool:
        stacks = self.expert_stacks
        if stacks is None or not self.use_grouped or x.dim() != 2:
            return False
        first = self.experts[0].gate_up_proj  # what the loader and LoRA set, they set on every expert
        if first.lora_slots is not None:  # --enable-lora: adapters' deltas on the experts' outputs
            return False
        # A bf16 copy for such rows (set_prefill_activations) wins, as in Linear.forward.
        return (first.bf16_weight is None or x.shape[0] < first.bf16_min_rows) and grouped_experts_available(
            stacks, x.shape[0], self.top_k
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        routing = route(self.gate(x), self.top_k, self.norm_topk_prob, x.dtype)
        self.last_routing = routing
        if self._grouped(x):
            assert self.expert_stacks is not None
            int8 = self.experts[0].gate_up_proj.decode_activations == "int8"  # set_prefill_activations
            out = grouped_experts(x, routing.expert_ids, routing.weights, self.expert_stacks, int8)
        else:
            out = self._expert_loop(x, routing)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            # The sigmoid gate scales the rank's partial sum (linear in it) before the reduce.
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.tp.size > 1:
            self.tp.all_reduce(out)
        return out

    def _expert_loop(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]: each active expert's Linears over its run of tokens.
        # Pairs (token, slot) flattened as token * k + slot, sorted by expert: expert e's
        # pairs are order[start_e : start_e + counts[e]].
        order = torch.argsort(routing.expert_ids.flatten(), stable=True)
        flat_weights = routing.weights.flatten()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(routing.counts):
            if n == 0:
                continue  # no token chose it: nothing computed, nothing read
            pairs = order[start : start + n]
            start += n
            tokens = pairs // self.top_k
            y = self.experts[e](x[tokens]) * flat_weights[pairs, None]
            out.index_add_(0, tokens, y)
        return out
