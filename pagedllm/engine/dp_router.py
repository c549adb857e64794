"""Which data-parallel replica gets a request: prefix-cache affinity, then load.

The router keeps, per replica, the block hashes of the prompts it sent there (as SGLang's
router keeps its approximate radix tree of what it routed), not the cores' published caches:
what a replica was sent is what it caches, known at once and at no messaging cost. Each
replica's map is an LRU bounded by that replica's KV pool (``num_blocks``), so it forgets
roughly as the core's cache evicts. A hash is the chain of ``block_size``-token blocks from
the prompt's start (a block's hash covers every token before it), so a match is a prefix.

A request goes to the replica holding its longest cached prefix (at least one full block)
unless that replica is overloaded: its load (requests in flight, i.e. waiting + running in
its core) exceeds the least loaded replica's by more than ``balance_abs_threshold`` and by the
factor ``balance_rel_threshold``, or its KV usage is above ``kv_usage_threshold``. Otherwise,
and when nothing matches, the least loaded replica (then the lowest KV usage, then the one
sent fewest requests, then the lowest index) gets it. Pure Python: no torch, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class ReplicaLoad:
    """What the router weighs for one live replica."""

    num_in_flight: int = 0
    """Requests sent there and not finished (the core's waiting + running)."""
    kv_cache_usage: float = 0.0
    """From the replica's latest stats, 0.0 .. 1.0."""
    num_routed: int = 0
    """Requests routed there so far: among equally loaded replicas the one sent fewest wins,
    so a trickle of distinct prompts spreads over the replicas."""


class PrefixAffinityRouter:
    def __init__(self, block_size: int, balance_abs_threshold: int = 8, balance_rel_threshold: float = 1.5,
                 kv_usage_threshold: float = 0.95) -> None:
        self.block_size = block_size
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.kv_usage_threshold = kv_usage_threshold
        self._cached: dict[int, OrderedDict[int, None]] = {}  # replica -> block hashes (LRU order)
        self._capacity: dict[int, int] = {}

    def add_replica(self, replica: int, num_blocks: int) -> None:
        """A replica (re)joins with an empty cache of ``num_blocks`` blocks."""
        self._cached[replica] = OrderedDict()
        self._capacity[replica] = max(1, num_blocks)

    def remove_replica(self, replica: int) -> None:
        self._cached.pop(replica, None)
        self._capacity.pop(replica, None)

    def block_hashes(self, token_ids: Sequence[int]) -> list[int]:
        """The chained hash of each full block of ``token_ids``."""
        hashes: list[int] = []
        parent = 0
        size = self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            parent = hash((parent, tuple(token_ids[start:start + size])))
            hashes.append(parent)
        return hashes

    def matched_blocks(self, replica: int, hashes: list[int]) -> int:
        cached = self._cached.get(replica)
        if not cached:
            return 0
        n = 0
        for h in hashes:
            if h not in cached:
                break
            n += 1
        return n

    def choose(self, hashes: list[int], loads: dict[int, ReplicaLoad]) -> int:
        """The replica for a prompt with these block hashes, among ``loads``' (live) replicas."""
        assert loads, "no live replica"
        least = min(loads, key=lambda r: (loads[r].num_in_flight, loads[r].kv_cache_usage, loads[r].num_routed, r))
        best, best_blocks = least, 0
        for replica in sorted(loads):
            n = self.matched_blocks(replica, hashes)
            if n > best_blocks:
                best, best_blocks = replica, n
        if best_blocks and not self._overloaded(loads[best], loads[least]):
            return best
        return least

    def _overloaded(self, candidate: ReplicaLoad, least: ReplicaLoad) -> bool:
        if candidate.kv_cache_usage > self.kv_usage_threshold:
            return True
        excess = candidate.num_in_flight - least.num_in_flight
        return (excess > self.balance_abs_threshold
                and candidate.num_in_flight > self.balance_rel_threshold * least.num_in_flight)

    def record(self, replica: int, hashes: list[int]) -> None:
        """The prompt with these hashes went to ``replica``: it will cache them."""
        cached = self._cached.get(replica)
        if cached is None:
            return
        for h in reversed(hashes):  # the root last, most recent: the deepest blocks are forgotten first
            cached[h] = None
            cached.move_to_end(h)
        capacity = self._capacity[replica]
        while len(cached) > capacity:
            cached.popitem(last=False)
