"""When to propose: speculation turned off per step and per request where it loses.

A verification step costs more rows than a plain decode step; the rows pay only while the
weights' memory traffic, not the arithmetic, bounds the step (few rows) and while drafts are
accepted. Two rules, each off unless configured (SpeculativeConfig):

- ``disable_by_batch_size`` (vLLM's key): a step that ran at least this many requests proposes
  no drafts, so the next step is a plain decode step (on a CPU a full batch is compute-bound:
  every draft row costs about what a request's decode row does).
- ``min_acceptance_rate``: a request whose recent drafts were accepted at a lower rate (an
  exponential average over its verification steps) gets no drafts for a while, and is
  offered drafts again after a backoff that doubles each time it fails again (up to
  ``_MAX_BACKOFF`` steps), so a request whose text turns repetitive later is found again.

A step without drafts then runs exactly as without speculation (the same rows; the rejection
sampler samples each request's one token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.config import SpeculativeConfig

# Weight of the newest verification step in a request's acceptance average.
_RATE_WEIGHT = 0.5
# The longest wait (in steps) before a request with poor acceptance is offered drafts again.
_MAX_BACKOFF = 32


@dataclass(slots=True)
class _Acceptance:
    rate: float = 1.0
    """Exponential average of accepted / proposed drafts over the request's verifications."""
    wait: int = 0
    """Steps left before the request is offered drafts again."""
    backoff: int = 1
    """The wait after its next failure (doubles per failure, reset by a good step)."""


class DraftPolicy:
    """Which of a step's sampled requests the proposer drafts for (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.disable_by_batch_size = config.disable_by_batch_size
        self.min_acceptance_rate = config.min_acceptance_rate
        self._acceptance: dict[str, _Acceptance] = {}

    def forget(self, req_ids: Sequence[str]) -> None:
        """Drop finished requests' records."""
        for req_id in req_ids:
            self._acceptance.pop(req_id, None)

    def observe(self, req_ids: Sequence[str], drafts: Sequence[list[int]], emitted: Sequence[list[int]]) -> None:
        """Record a verification step: request i proposed drafts[i] and emitted emitted[i]
        (its accepted drafts, then one more token)."""
        if self.min_acceptance_rate is None:
            return
        for req_id, draft, tokens in zip(req_ids, drafts, emitted):
            if not draft:
                continue
            record = self._acceptance.setdefault(req_id, _Acceptance())
            accepted = (len(tokens) - 1) / len(draft)
            record.rate = (1 - _RATE_WEIGHT) * record.rate + _RATE_WEIGHT * accepted
            if record.rate < self.min_acceptance_rate:
                record.wait, record.backoff = record.backoff, min(2 * record.backoff, _MAX_BACKOFF)
                record.rate = self.min_acceptance_rate  # a fresh start when offered again
            else:
                record.backoff = 1

    def proposing(self, req_ids: Sequence[str], num_step_reqs: int) -> list[int]:
        """Indices into req_ids (the requests that just sampled) to draft for; the step ran
        num_step_reqs requests (sampled or not)."""
        if self.disable_by_batch_size is not None and num_step_reqs >= self.disable_by_batch_size:
            return []
        if self.min_acceptance_rate is None:
            return list(range(len(req_ids)))
        chosen = []
        for i, req_id in enumerate(req_ids):
            record = self._acceptance.get(req_id)
            if record is not None and record.wait > 0:
                record.wait -= 1
                continue
            chosen.append(i)
        return chosen
