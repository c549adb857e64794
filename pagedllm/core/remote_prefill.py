"""Disaggregated prefill, the scheduler's part: requests whose prompt KV is pulled from a
prefill instance (decode side), and finished prompts whose blocks stay held for such a pull
(prefill side).

A pulled request holds blocks outside ``waiting`` and ``running`` while the connector pulls
(``waiting_for_remote``); blocks are entered into the prefix cache only once their KV has
arrived (delayed caching). An aborted request whose pull is still writing into its blocks
keeps them until the pull ends. A request waits at most the connector's
``remote_wait_timeout_s``: then it fails (``expire``), and its blocks are freed once the
connector's worker side, which gives the pull up a little later, reports it ended. Holds for
a remote pull are capped (``hold_limits``): beyond them a prefill holds nothing. The KV manager must declare both capabilities
(``KVCapabilities.kv_transfer`` and ``delayed_caching``); one without them refuses by name
when this part is built.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, NamedTuple

from pagedllm.core.kv_manager import KVManager
from pagedllm.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagedllm.distributed.kv_transfer.base import KVConnectorOutput, KVConnectorSchedulerBase

logger = logging.getLogger(__name__)


class EndedPull(NamedTuple):
    """A request whose pull ended: its blocks are freed, its computed tokens reset."""

    request: Request
    error: str | None
    """Why the pull failed; None when its blocks entered the prefix cache."""


class RemotePrefill:
    """The scheduler side of a KV connector over a manager's KV-transfer capability."""

    def __init__(self, connector: KVConnectorSchedulerBase, kv_manager: KVManager) -> None:
        self.connector = connector
        self.kv_manager = kv_manager
        self.kv = kv_manager.kv_transfer()  # ValueError naming a backend without it
        kv_manager.check_delayed_caching(True)
        self.waiting_for_remote: dict[str, Request] = {}
        self.aborted_loading: dict[str, Request] = {}
        self._deadlines: dict[str, float] = {}  # request id -> when its wait for KV ends
        self._held_blocks: dict[str, int] = {}  # hold id -> blocks held
        max_held, max_blocks = connector.hold_limits()
        if max_blocks is None and max_held is not None:  # default: half of the pool
            max_blocks = max(0, (getattr(kv_manager, "num_blocks", 0) - 1) // 2) or None
        self.max_held, self.max_held_blocks = max_held, max_blocks

    @staticmethod
    def wants_pull(request: Request) -> bool:
        return bool((request.kv_transfer_params or {}).get("do_remote_prefill"))

    @property
    def has_pending(self) -> bool:
        """Blocks held for a remote pull: the engine keeps polling the connector."""
        return self.kv.num_held > 0

    def admit(self, request: Request, num_running: int, max_num_seqs: int) -> bool | None:
        """Allocate blocks for what a prefill instance can send of ``request`` (the head of
        ``waiting``) and park it in ``waiting_for_remote`` while the connector pulls.

        Returns None when nothing is to be pulled (the normal admission follows), else
        whether the request was parked (the caller then takes it out of ``waiting``).
        """
        kv_manager = self.kv_manager
        if request.group_id is not None or request.pending_forks or request.num_preemptions:
            self.connector.release(request)
            request.kv_transfer_params = None
            return None
        computed_blocks, num_hit_tokens = kv_manager.get_computed_blocks(request)
        num_external, _ = self.connector.get_num_new_matched_tokens(request, num_hit_tokens)
        if num_external == 0:
            request.kv_transfer_params = None
            return None
        if num_running + len(self.waiting_for_remote) >= max_num_seqs:
            return False
        allocation = kv_manager.allocate_slots(request, num_external, computed_blocks, delay_cache_blocks=True)
        if allocation is None:
            return False
        first = num_hit_tokens // self.kv.block_size
        last = first + num_external // self.kv.block_size
        block_ids = kv_manager.get_block_ids(request.request_id)[0][first:last]
        self.connector.update_state_after_alloc(request, block_ids, self.kv.get_block_hashes(request)[first:last])
        # The blocks are not computed until the pull ends; the hit blocks are.
        request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote[request.request_id] = request
        timeout_s = self.connector.remote_wait_timeout_s()
        if timeout_s is not None:
            self._deadlines[request.request_id] = time.monotonic() + timeout_s
        return True

    def expire(self, now: float | None = None) -> list[Request]:
        """Requests whose wait for remote KV passed its deadline: they leave
        ``waiting_for_remote`` (their blocks are freed once the pull is reported ended)."""
        now = time.monotonic() if now is None else now
        expired = [rid for rid, deadline in self._deadlines.items() if now > deadline]
        requests = []
        for request_id in expired:
            del self._deadlines[request_id]
            request = self.waiting_for_remote.get(request_id)
            if request is not None and self.abort(request_id):
                requests.append(request)
        return requests

    def abort(self, request_id: str) -> bool:
        """Whether ``request_id`` was being pulled; its blocks are then freed when the pull
        ends (it still writes into them)."""
        request = self.waiting_for_remote.pop(request_id, None)
        self._deadlines.pop(request_id, None)
        if request is None:
            return False
        self.aborted_loading[request_id] = request
        return True

    def take_ended_pulls(self, kv_output: KVConnectorOutput) -> list[EndedPull]:
        """Free the blocks whose transfer ended. A pulled request enters its blocks into the
        prefix cache and frees them (its admission then finds the prompt as a prefix hit); a
        failed pull frees them uncached."""
        for hold_id in kv_output.finished_sending:
            self.kv.release_held(hold_id)
            self._held_blocks.pop(hold_id, None)
        ended: list[EndedPull] = []
        for request_id in [*kv_output.finished_recving, *kv_output.failed_recving]:
            aborted = self.aborted_loading.pop(request_id, None)
            if aborted is not None:
                self.kv_manager.free(aborted)
                continue
            request = self.waiting_for_remote.pop(request_id, None)
            self._deadlines.pop(request_id, None)
            if request is None:
                continue
            error = kv_output.failed_recving.get(request_id)
            if error is None:
                self.kv.cache_blocks(request, self.kv.get_num_blocks(request_id) * self.kv.block_size)
            self.kv_manager.free(request)
            request.num_computed_tokens = 0
            request.kv_transfer_params = None
            ended.append(EndedPull(request, error))
        return ended

    def hold_for_pull(self, request: Request) -> dict | None:
        """A finished request's prompt blocks may stay held for a remote pull; returns the
        kv_transfer_params that tell the client where to pull them from (or None)."""
        if request.kv_transfer_params is None:
            return None
        num_full = min(request.num_computed_tokens, request.num_prompt_tokens) // self.kv.block_size
        if not self._may_hold(request, num_full):
            return None
        block_ids = self.kv_manager.get_block_ids(request.request_id)[0][:num_full]
        hashes = self.kv.get_block_hashes(request)[:num_full]
        hold_id, params = self.connector.request_finished(request, block_ids, hashes)
        if hold_id is not None:
            self.kv.hold(hold_id, request, num_full)
            self._held_blocks[hold_id] = num_full
        return params

    def _may_hold(self, request: Request, num_blocks: int) -> bool:
        """Whether one more hold of ``num_blocks`` stays within the hold limits (only a
        request asking for a remote decode counts)."""
        if not (request.kv_transfer_params or {}).get("do_remote_decode") or not num_blocks:
            return True
        if self.max_held is not None and len(self._held_blocks) >= self.max_held:
            why = f"{len(self._held_blocks)} prompts are held already (kv_max_held_transfers)"
        elif self.max_held_blocks is not None and sum(self._held_blocks.values()) + num_blocks > self.max_held_blocks:
            why = f"{sum(self._held_blocks.values())} blocks are held already (kv_max_held_blocks)"
        else:
            return True
        logger.warning("request %s: its prompt's KV is not held for a remote decode: %s", request.request_id, why)
        return False
