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
    """torch.Tensor [len(req_ids), ceil(vocab_size / 32)] int32: bit j of word w allows token
    32 * w + j (xgrammar's packed layout)."""


def apply_grammar_bitmask(logits: Any, grammar_bitmask: GrammarBitmask, req_ids: list[str]) -> None:
    """Set the logits of disallowed tokens to -inf, in place, for the constrained rows only.

    logits: [B, V] float32, row b belongs to req_ids[b]. Unconstrained rows are untouched.
    """
    import torch
    import xgrammar as xgr

    row_of = {r: i for i, r in enumerate(req_ids)}
    pairs = [(row_of[r], i) for i, r in enumerate(grammar_bitmask.req_ids) if r in row_of]
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
    return GrammarBitmask([*grammar_bitmask.req_ids, *forced], torch.cat([grammar_bitmask.bitmask, rows]))
