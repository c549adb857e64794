"""Logprobs of the model's raw distribution: top-k candidates plus the chosen token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.core.sched_output import PositionLogprobsData


@dataclass
class LogprobsTensors:
    token_ids: torch.Tensor  # [N, 1 + K] int64: the chosen token, then the top-K
    logprobs: torch.Tensor  # [N, 1 + K] float32
    ranks: torch.Tensor  # [N] int64, rank of the chosen token (1 = most likely)

    def tolists(self, num_logprobs: list[int]) -> list[PositionLogprobsData]:
        """One entry per row, keeping the chosen token and that row's first k candidates."""
        ids, lps, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        return [
            PositionLogprobsData(ids[i][: 1 + k], lps[i][: 1 + k], ranks[i])
            for i, k in enumerate(num_logprobs)
        ]


def compute_logprobs(logits: torch.Tensor, chosen: torch.Tensor, max_k: int) -> LogprobsTensors:
    """logits: [N, V] float32 raw; chosen: [N] int64 -> top-max_k plus the chosen token."""
    logprobs = logits.log_softmax(dim=-1)  # [N, V]
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))  # [N, 1]
    # Rank: 1 + how many tokens are strictly more likely than the chosen one.
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    top = logprobs.topk(max_k, dim=-1) if max_k > 0 else None
    token_ids = chosen.unsqueeze(1)
    values = chosen_lp
    if top is not None:
        token_ids = torch.cat([token_ids, top.indices], dim=1)
        values = torch.cat([values, top.values], dim=1)
    return LogprobsTensors(token_ids, values, ranks)
