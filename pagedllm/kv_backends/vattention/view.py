"""The dashboard's picture of the vattention backend: reserved and resident pages per request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedllm.kv_backends.vattention.manager import VAttentionKVManager
from pagedllm.request import Request


@dataclass
class SlotPages:
    request: str | None
    """The request in the slot; None for an idle slot still holding pages."""
    slot: int
    resident_pages: int
    """Pages charged to the slot, over every (K or V, layer) region."""
    reserved_pages: int
    """Pages of the slot's reservation (its capacity), over every region."""
    num_tokens: int
    """Computed tokens of the request (0 for an idle slot)."""


@dataclass
class SlotKVView:
    """Page accounting at one instant (plain data)."""

    page_bytes: int
    num_pages: int
    """The budget, in pages."""
    num_used_pages: int
    """Pages charged to slots, idle ones included (released on demand)."""
    usage: float
    slots: list[SlotPages]
    """Slots in use first (by slot), then idle slots holding pages."""
    num_allocated_slots: int
    """Token slots the resident pages of slots in use could hold."""
    num_empty_slots: int
    """Of those, slots holding no computed token: internal fragmentation (page tails)."""

    def to_json(self) -> dict[str, Any]:
        allocated = self.num_allocated_slots
        in_use = sum(s.resident_pages for s in self.slots if s.request is not None)
        return {
            "kind": "pages",
            "page_bytes": self.page_bytes,
            "num_pages": self.num_pages,
            "num_used_pages": self.num_used_pages,
            "num_in_use": in_use,
            "usage": self.usage,
            "slots": [vars(s) for s in self.slots],
            "num_allocated_slots": allocated,
            "num_empty_slots": self.num_empty_slots,
            "fragmentation": self.num_empty_slots / allocated if allocated else 0.0,
        }


def take_slot_view(kv: VAttentionKVManager, running: Sequence[Request]) -> SlotKVView:
    slot_of, resident = kv.slot_pages()
    computed = {r.request_id: r.num_computed_tokens for r in running}
    regions, reserved = kv.num_regions, kv.reserved_pages()
    tokens_per_page = kv.page_bytes / kv.token_bytes
    slots: list[SlotPages] = []
    allocated = empty = 0
    for request_id, slot in sorted(slot_of.items(), key=lambda item: item[1]):
        num_tokens = computed.get(request_id, 0)
        slots.append(SlotPages(request_id, slot, regions * resident[slot], regions * reserved, num_tokens))
        capacity = int(resident[slot] * tokens_per_page)  # tokens one region's pages hold
        allocated += capacity
        empty += max(0, capacity - num_tokens)
    slots += [
        SlotPages(None, s, regions * resident[s], regions * reserved, 0)
        for s in range(kv.num_slots)
        if resident[s] and kv.is_idle(s)
    ]
    return SlotKVView(
        page_bytes=kv.page_bytes,
        num_pages=kv.num_pages,
        num_used_pages=kv.resident_bytes // kv.page_bytes,
        usage=kv.usage,
        slots=slots,
        num_allocated_slots=allocated,
        num_empty_slots=empty,
    )
