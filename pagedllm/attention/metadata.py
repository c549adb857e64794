"""The per-step attention metadata: the contract between the KV workers that build it, the
model runner, CUDA graphs, the fused decode and the attention backends that read it.

Per-step metadata reaches every Attention layer through one scoped forward context, set by
the model runner around the forward pass.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Iterator, TypeVar

import numpy as np
import torch

_T = TypeVar("_T", torch.Tensor, list)


@dataclass
class AttentionMetadata:
    """Where each token of the flat batch reads and writes the KV cache.

    Requests are ordered decodes first (query length 1), then prefill chunks. Which of the
    per-request fields a backend reads is its KV layout's business (attention/layouts.py):
    block tables, or contiguous slots.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, physical slot of each token
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int64, padded with the null block 0
    seq_lens: torch.Tensor  # [num_reqs] int64, context length including this step's tokens
    query_start_loc: list[int]  # [num_reqs + 1], token offsets of each request's queries
    seq_lens_list: list[int]  # seq_lens as Python ints
    num_decodes: int  # the first num_decodes requests have exactly one query token
    block_size: int
    slots: torch.Tensor | None = None
    """Contiguous-slot layout: [num_reqs] int64, each request's slot (block_tables is then
    empty; the cache is [2, num_slots, capacity, Hkv, D], a request's KV cache[:, slot, :len])."""
    slots_list: list[int] | None = None
    query_start_loc_tensor: torch.Tensor | None = None
    """query_start_loc as a [num_reqs + 1] int64 tensor on the cache's device (device kernels)."""
    max_query_len: int | None = None
    """The longest query run of the step (host int; device kernels size their launch by it)."""

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_list)

    @functools.cached_property
    def longest_query_run(self) -> int:
        """The longest query run of the step (max_query_len where the builder set it)."""
        if self.max_query_len is not None:
            return self.max_query_len
        starts = self.query_start_loc
        return max((b - a for a, b in zip(starts, starts[1:])), default=0)

    @functools.cached_property
    def row_decodes(self) -> AttentionMetadata:
        """Every query row of the step as a one-token decode of its own context: the row at
        position p of request r reads r's K/V over [0, p] (r's block table or slot, the
        step's K/V already written), which is causal attention over a short run after a
        cached context (speculative verification) in the decode kernels' form. Built once
        per step (cached); the step itself when it is all decodes."""
        if self.num_decodes == self.num_reqs:
            return self
        starts = np.asarray(self.query_start_loc, dtype=np.int64)  # [R + 1]
        counts = np.diff(starts)  # [R]
        num_rows = int(starts[-1])
        req_of_row = np.repeat(np.arange(len(counts)), counts)  # [T]
        # Row t of request r sits at position seq_len[r] - (end[r] - t): its context length
        # is that position + 1.
        rows_after = starts[1:][req_of_row] - 1 - np.arange(num_rows)  # [T] later rows of its run
        row_lens = np.asarray(self.seq_lens_list, dtype=np.int64)[req_of_row] - rows_after  # [T]
        device = self.seq_lens.device
        index = torch.from_numpy(req_of_row).to(device)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping,
            block_tables=_per_request(self.block_tables, index, req_of_row),
            seq_lens=torch.from_numpy(row_lens).to(device),
            query_start_loc=list(range(num_rows + 1)),
            seq_lens_list=row_lens.tolist(),
            num_decodes=num_rows,
            block_size=self.block_size,
            slots=_per_request(self.slots, index, req_of_row),
            slots_list=_per_request(self.slots_list, index, req_of_row),
            max_query_len=1,
        )


def _per_request(field: _T | None, index: torch.Tensor, rows: np.ndarray) -> _T | None:
    """A per-request field repeated for each row (``index``/``rows``: the request of each
    row); a field the layout leaves unset (None, or an empty [0, 0] table) stays as it is."""
    if field is None or len(field) == 0:
        return field
    if isinstance(field, list):
        return [field[r] for r in rows.tolist()]
    return field.index_select(0, index.to(field.device))


# One metadata for every layer, or one per KV cache group (indexed by the layer's group).
_forward_metadata: AttentionMetadata | list[AttentionMetadata] | None = None


@contextlib.contextmanager
def forward_context(metadata: AttentionMetadata | list[AttentionMetadata]) -> Iterator[None]:
    """Make `metadata` visible to every Attention layer for one forward pass.

    A list gives each KV cache group its own metadata (groups differ only in slot_mapping
    and block_tables: each group's layers keep their KV in that group's blocks).
    """
    global _forward_metadata
    prev, _forward_metadata = _forward_metadata, metadata
    try:
        yield
    finally:
        _forward_metadata = prev


def get_attention_metadata(kv_cache_group: int = 0) -> AttentionMetadata:
    md = _forward_metadata
    assert md is not None, "Attention called outside forward_context()"
    return md[kv_cache_group] if isinstance(md, list) else md
