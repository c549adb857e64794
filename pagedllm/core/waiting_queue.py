"""The waiting queue and its policy: where a request waits, and whom memory pressure preempts.

Two policies, chosen by ``SchedulerConfig.scheduling_policy``:
- ``fcfs``: arrival order; a request going back (preempted, resumed) goes to the front. The
  newest running request is the preemption victim, so a request that preempts itself ends
  the step's running pass (nothing after it may run).
- ``priority``: ordered by (priority, arrival time); one going back goes before the requests
  of equal key, a new one after them. The victim is the lowest priority (largest value), the
  latest arrival among equals, and may stand anywhere in ``running``.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Iterator

from pagedllm.request import Request


def priority_key(request: Request) -> tuple[int, float]:
    """Smaller is scheduled first and preempted last (vLLM's rule)."""
    return request.priority, request.arrival_time


class WaitingQueue:
    """Requests without KV, in the order they are admitted (FCFS)."""

    victims_anywhere = False
    """Whether a preemption victim may stand before the request that needed the memory."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request, *, front: bool) -> None:
        """At the back, or the front for a request going back (preempted, resumed)."""
        if front:
            self._queue.appendleft(request)
        else:
            self._queue.append(request)

    def victim_index(self, running: list[Request]) -> int:
        """Index in ``running`` of the request to preempt first: the newest."""
        return len(running) - 1

    # ---- the deque's reading and popping side ------------------------------------------

    def popleft(self) -> Request:
        return self._queue.popleft()

    def push_front(self, requests: list[Request]) -> None:
        """Put ``requests`` back at the front, in their order (taken out by ``popleft``)."""
        self._queue.extendleft(reversed(requests))

    def remove_ids(self, request_ids: set[str]) -> None:
        self._queue = deque(r for r in self._queue if r.request_id not in request_ids)

    def __getitem__(self, index: int) -> Request:
        return self._queue[index]

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)


class PriorityWaitingQueue(WaitingQueue):
    """Requests without KV by (priority, arrival time)."""

    victims_anywhere = True

    def add(self, request: Request, *, front: bool) -> None:
        """Before the requests of equal key when going back, after them when new."""
        keys = [priority_key(r) for r in self._queue]
        bisect = bisect_left if front else bisect_right
        self._queue.insert(bisect(keys, priority_key(request)), request)

    def victim_index(self, running: list[Request]) -> int:
        """The lowest priority (the largest value), the latest arrival among equals."""
        return max(range(len(running)), key=lambda i: priority_key(running[i]))


WAITING_QUEUES: dict[str, type[WaitingQueue]] = {"fcfs": WaitingQueue, "priority": PriorityWaitingQueue}
"""The queue of each ``SchedulerConfig.scheduling_policy``."""


def make_waiting_queue(policy: str) -> WaitingQueue:
    """An empty queue of ``policy`` (ValueError naming the choices otherwise)."""
    if policy not in WAITING_QUEUES:
        raise ValueError(f"scheduling_policy={policy!r} is not one of {', '.join(WAITING_QUEUES)}")
    return WAITING_QUEUES[policy]()
