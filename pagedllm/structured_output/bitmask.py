"""The token bitmask of one step: built by the manager, applied to logits by the runner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class GrammarBitmask:
    """Which tokens each constrained request may sample this step (plain data)."""

    req_ids: list[str]
    """Constrained requests that sample this step; row i of ``bitmask`` is req_ids[i]'s."""
    bitmask: Any
    """torch.Tensor [sum(num_rows), ceil(vocab_size / 32)] int32: bit j of word w allows token
    32 * w + j (xgrammar's packed layout)."""
    num_rows: list[int] | None = None
    """Rows per request, consecutive (speculative decoding: 1 + its drafts); None: one each."""

    def row_counts(self) -> list[int]:
        return self.num_rows if self.num_rows is not None else [1] * len(self.req_ids)


def apply_grammar_bitmask(logits: Any, grammar_bitmask: GrammarBitmask, req_ids: list[str],
                          logits_rows: list[int] | None = None) -> None:
    """Set the logits of disallowed tokens to -inf, in place, for the constrained rows only.

    logits: [B, V] float32; request i (req_ids[i]) owns ``logits_rows[i]`` consecutive rows
    (None: one each). Unconstrained rows are untouched.
    """
    import torch
    import xgrammar as xgr

    logits_rows = logits_rows or [1] * len(req_ids)
    logits_start, start = {}, 0
    for r, n in zip(req_ids, logits_rows):
        logits_start[r] = (start, n)
        start += n
    pairs = []  # (logits row, bitmask row)
    mask_start = 0
    for r, n in zip(grammar_bitmask.req_ids, grammar_bitmask.row_counts()):
        if r in logits_start:
            first, count = logits_start[r]
            pairs.extend((first + j, mask_start + j) for j in range(min(n, count)))
        mask_start += n
    if not pairs:
        return
    batch_rows = [b for b, _ in pairs]
    # xgrammar indexes logits and bitmask by the same row: lay the masks out in batch order.
    batch_mask = torch.empty((logits.shape[0], grammar_bitmask.bitmask.shape[1]), dtype=torch.int32)
    batch_mask[batch_rows] = grammar_bitmask.bitmask[[i for _, i in pairs]]
    batch_mask = batch_mask.to(logits.device)
    xgr.apply_token_bitmask_inplace(logits, batch_mask, vocab_size=logits.shape[1], indices=batch_rows)


def with_forced_tokens(grammar_bitmask: GrammarBitmask | None, forced: dict[str, int],
                       vocab_size: int) -> GrammarBitmask:
    """``grammar_bitmask`` plus one row per request in ``forced`` (request id -> the one token
    it may sample this step: the thinking budget's end marker); a forced request has no grammar
    row (its grammar waits for the reasoning's end)."""
    import torch

    rows = torch.zeros((len(forced), (vocab_size + 31) // 32), dtype=torch.int32)  # [F, W]
    for row, token_id in enumerate(forced.values()):
        bit = token_id % 32
        rows[row, token_id // 32] = (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32's sign bit
    if grammar_bitmask is None:
        return GrammarBitmask(list(forced), rows)
    num_rows = None if grammar_bitmask.num_rows is None else [*grammar_bitmask.num_rows, *[1] * len(forced)]
    return GrammarBitmask([*grammar_bitmask.req_ids, *forced], torch.cat([grammar_bitmask.bitmask, rows]), num_rows)
