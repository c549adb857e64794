"""The LoRA delta of one projection for a whole mixed batch, in one batched computation.

Punica's BGMV idea in dense form. Each adaptable Linear holds its adapters' weights stacked
over `max_loras` slots, every slot padded to `max_lora_rank` per section (a fused projection
has one section per checkpoint projection: q/k/v of a QKV, gate/up of a gate_up):

    lora_a: [S * R, K]   rows slot * R + section * r_max + j  (R = sections * r_max)
    lora_b: [S * R, N]   row blocks likewise (B transposed, so the fused decode adds each
                         rank row to a contiguous run of outputs); a section's B fills only
                         its own output columns

For the step's tokens x: [T, K], grouped by slot (``LoRAMapping.groups``: the rows of each
slot in use), per slot s with rows I_s:

    y[I_s] += (x[I_s] @ A_s^T) @ B_s        A_s, B_s: slot s's R rows of lora_a / lora_b

Rows without an adapter are not touched at all, and no row reads another slot's weights: a
NaN or Inf in one adapter (or a stale slot) cannot reach another request's rows (a one-hot
product over all slots would: NaN * 0 is NaN).

The fused decode (models/fused_decode.py) computes the same deltas in C++
(kernels/csrc/lora_delta.h), per group of rows sharing a slot. Padding rows/columns are zero, so adapters of different ranks (and adapters on a subset of a
fused projection's sections, or of the model's projections) share the slots exactly. The
per-step mapping reaches every layer through one scoped context (`lora_context`), as the
attention metadata does.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from pagedllm.lora.checkpoint import LoRAModuleWeights


@dataclass(frozen=True)
class LoRAMapping:
    """Which adapter slot each token of the step uses."""

    one_hot: torch.Tensor  # [T, S] in the model's dtype; a row of zeros: no adapter
    row_slots: torch.Tensor  # [T] int64, each token's slot, -1: no adapter (the fused decode's form)
    groups: tuple[tuple[int, torch.Tensor], ...] = ()
    """(slot, int64 indices of its rows) for each slot in use this step."""


_mapping: LoRAMapping | None = None


@contextlib.contextmanager
def lora_context(mapping: LoRAMapping | None) -> Iterator[None]:
    """Make `mapping` visible to every adapted layer for one forward pass (None: no adapters)."""
    global _mapping
    prev, _mapping = _mapping, mapping
    try:
        yield
    finally:
        _mapping = prev


def active_mapping() -> LoRAMapping | None:
    """The mapping of the forward in progress, None when no token of it has an adapter."""
    return _mapping


class LinearLoRASlots:
    """The stacked adapter weights of one Linear (see the module docstring)."""

    def __init__(
        self, in_features: int, sections: dict[object, tuple[int, int]], max_loras: int, max_rank: int,
        dtype: torch.dtype, device: torch.device | str = "cpu",
    ) -> None:
        """``sections``: shard id -> (first output row, rows), e.g. {"q": (0, 256), ...}."""
        self.sections = sections
        self.section_index = {shard: i for i, shard in enumerate(sections)}
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.width = len(sections) * max_rank  # R
        out_features = sum(size for _, size in sections.values())
        self.lora_a = torch.zeros(max_loras * self.width, in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras * self.width, out_features, dtype=dtype, device=device)

    @property
    def section_rows(self) -> list[int]:
        """Output row offsets of the sections, len(sections) + 1 entries."""
        offsets = [offset for offset, _ in self.sections.values()]
        return [*offsets, offsets[-1] + list(self.sections.values())[-1][1]]

    def set_slot(self, slot: int, weights: dict[object, LoRAModuleWeights]) -> None:
        """Fill `slot` with an adapter's sections (absent sections: zero)."""
        self.clear_slot(slot)
        for shard, w in weights.items():
            offset, size = self.sections[shard]
            start = slot * self.width + self.section_index[shard] * self.max_rank
            self.lora_a[start : start + w.rank].copy_(w.lora_a)
            self.lora_b[start : start + w.rank, offset : offset + size].copy_(w.lora_b.t())

    def clear_slot(self, slot: int) -> None:
        cols = slice(slot * self.width, (slot + 1) * self.width)
        self.lora_a[cols].zero_()
        self.lora_b[cols].zero_()

    def add_delta(self, x: torch.Tensor, y: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
        # x: [T, K], y: [T, N] (the base projection's output) -> y + delta, per slot's rows
        groups = mapping.groups or slot_groups(mapping.row_slots)
        out = y.clone()
        for slot, rows in groups:
            span = slice(slot * self.width, (slot + 1) * self.width)
            u = x.index_select(0, rows).to(self.lora_a.dtype) @ self.lora_a[span].t()  # [T_s, R]
            out.index_add_(0, rows, (u @ self.lora_b[span]).to(y.dtype))
        return out


def slot_groups(row_slots: torch.Tensor) -> tuple[tuple[int, torch.Tensor], ...]:
    """(slot, its rows) for each slot in ``row_slots`` (-1: no adapter, left out)."""
    return tuple((int(s), (row_slots == s).nonzero().flatten()) for s in row_slots.unique().tolist() if s >= 0)


def add_lora_delta(slots: LinearLoRASlots | None, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y plus the adapters' delta where this step has adapters (the Linear layers' hook)."""
    mapping = _mapping
    if slots is None or mapping is None:
        return y
    return slots.add_delta(x, y, mapping)
