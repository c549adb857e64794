"""Group admission: KV for the head of ``waiting`` and the rest of its group, all or nothing.

A fresh group (n > 1) enters as its leader, which computes the prompt but its last token
before the others fork from it; a preempted group resumes every member at once, sharing the
prompt through the prefix cache. If one member's blocks do not fit, every allocation made
for the group is rolled back and the group waits whole (nothing overtakes it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from pagedllm.core.kv_manager import KVManager
from pagedllm.request import Request


class AdmittedSeq(NamedTuple):
    """A waiting sequence whose blocks were allocated this step."""

    request: Request
    num_new_tokens: int
    block_ids: list[list[int]]
    """Every block id the request holds, per group (it held none before)."""
    num_hit_tokens: int
    """Prompt tokens found in the prefix cache (computed already)."""


def num_tokens_to_compute(request: Request, num_hit_tokens: int = 0) -> int:
    """Tokens still to compute; a leader stops before the prompt's last token until its
    group has forked."""
    end = request.num_tokens - 1 if request.pending_forks else request.num_tokens
    return end - max(request.num_computed_tokens, num_hit_tokens)


def waiting_group(waiting: Sequence[Request], head: Request) -> list[Request]:
    """``head`` (``waiting[0]``) and the members of its group right behind it."""
    members = [head]
    while (
        head.group_id is not None
        and len(members) < len(waiting)
        and waiting[len(members)].group_id == head.group_id
    ):
        members.append(waiting[len(members)])
    return members


class GroupAdmission:
    """Allocates a waiting group's KV (prefix hits first) under the step's token budget."""

    def __init__(self, kv_manager: KVManager, num_lookahead_tokens: int) -> None:
        self.kv_manager = kv_manager
        self.num_lookahead_tokens = num_lookahead_tokens
        """Slots past each sequence's tokens for a draft model's proposals."""

    def allocate(self, members: list[Request], token_budget: int) -> list[AdmittedSeq] | None:
        """Blocks for every member within ``token_budget``; None, with every allocation
        rolled back, when one does not fit. ``members`` grows by a leader's pending forks
        when the cache holds all of its prompt but the last token."""
        kv = self.kv_manager
        admitted: list[AdmittedSeq] = []
        i = 0
        while i < len(members):
            request = members[i]
            assert request.num_computed_tokens == 0
            if request.reads_whole_prompt:  # its pooling needs every prompt token's state
                computed_blocks, num_hit_tokens = None, 0
            else:
                computed_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            # Leave each later member at least one token of the budget.
            budget = token_budget - sum(seq.num_new_tokens for seq in admitted) - (len(members) - i - 1)
            num_new_tokens = min(num_tokens_to_compute(request, num_hit_tokens), budget)
            if request.pending_forks and num_new_tokens == 0:
                # The cache holds all of the prompt but its last token: no fork needed, the
                # members share those blocks as prefix hits and each computes the last token.
                members.extend(request.pending_forks)
                request.pending_forks = []
                continue
            allocation = kv.allocate_slots(
                request, num_new_tokens, computed_blocks, num_lookahead_tokens=self.num_lookahead_tokens
            )
            # A request without blocks has nothing shared to copy on write.
            block_ids = allocation.block_ids if allocation is not None else None
            if block_ids is None or num_new_tokens <= 0:
                rollback = admitted + ([AdmittedSeq(request, 0, block_ids, num_hit_tokens)] if block_ids else [])
                for seq in rollback:
                    kv.free(seq.request, num_valid_tokens=seq.num_hit_tokens)
                return None
            admitted.append(AdmittedSeq(request, num_new_tokens, block_ids, num_hit_tokens))
            i += 1
        return admitted
