"""ZmqConnector, scheduler side: decides what to hold, pull and release (torch-free).

kv_transfer_params, as the proxy and vLLM's NIXL connector use them:

- request to a prefill instance: ``{"do_remote_decode": true}``; the producer then holds the
  prompt's full blocks after its one-token prefill and answers
  ``{"do_remote_prefill": true, "remote_host", "remote_port", "remote_transfer_id",
  "remote_num_blocks", "remote_engine_id"}``;
- request to a decode instance: those params; it pulls the blocks by their prefix-cache hashes.
"""

from __future__ import annotations

import logging
import uuid

from pagedllm.kv_backends.paged.kv_cache_utils import BlockHash
from pagedllm.distributed.kv_transfer.base import (
    HoldDecision,
    KVConnectorMetadata,
    KVConnectorSchedulerBase,
    LoadSpec,
    ReleaseSpec,
    SendSpec,
)
from pagedllm.distributed.kv_transfer.config import KVTransferConfig
from pagedllm.request import Request, RequestStatus

logger = logging.getLogger(__name__)

_REMOTE_KEYS = ("remote_host", "remote_port", "remote_transfer_id", "remote_num_blocks")


def validate_kv_transfer_params(params: object) -> None:
    """Raise ValueError (a 400 at the server) unless ``params`` is a usable request field."""
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be a JSON object")
    if params.get("do_remote_prefill"):
        missing = [k for k in _REMOTE_KEYS if params.get(k) is None]
        if missing:
            raise ValueError(
                f"kv_transfer_params with do_remote_prefill=true needs {', '.join(missing)} "
                "(pass on the kv_transfer_params of the prefill instance's response)"
            )
        if not isinstance(params["remote_num_blocks"], int) or not isinstance(params["remote_port"], int):
            raise ValueError("kv_transfer_params: remote_num_blocks and remote_port must be integers")


class ZmqConnectorScheduler(KVConnectorSchedulerBase):
    def __init__(self, config: KVTransferConfig, block_size: int, engine_id: str | None = None) -> None:
        self.config = config
        self.block_size = block_size
        self.engine_id = engine_id or uuid.uuid4().hex
        self._meta = KVConnectorMetadata()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not self.config.is_consumer or not params or not params.get("do_remote_prefill"):
            return 0, False
        # The last prompt token is always computed here (its logits give the first token).
        num_blocks = min(int(params["remote_num_blocks"]), (request.num_tokens - 1) // self.block_size)
        num_new = max(0, num_blocks * self.block_size - num_computed_tokens)
        if num_new == 0:  # everything is cached here already: the producer can let go
            self.release(request)
        return num_new, True

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], block_hashes: list[BlockHash]
    ) -> None:
        params = request.kv_transfer_params
        assert params is not None and len(block_ids) == len(block_hashes)
        self._meta.loads.append(
            LoadSpec(
                req_id=request.request_id,
                transfer_id=str(params["remote_transfer_id"]),
                remote_host=str(params["remote_host"]),
                remote_port=int(params["remote_port"]),
                block_hashes=list(block_hashes),
                block_ids=list(block_ids),
            )
        )

    def release(self, request: Request) -> None:
        """The request will not pull its remote blocks (cached here, or recomputing)."""
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            self._meta.releases.append(
                ReleaseSpec(str(params["remote_transfer_id"]), str(params["remote_host"]), int(params["remote_port"]))
            )

    def request_finished(
        self, request: Request, block_ids: list[int], block_hashes: list[BlockHash]
    ) -> HoldDecision:
        params = request.kv_transfer_params
        wants = self.config.is_producer and params is not None and params.get("do_remote_decode")
        # An aborted request has no client waiting for params; no full block, nothing to pull.
        if not wants or request.status == RequestStatus.FINISHED_ABORTED or not block_ids:
            return HoldDecision(None, None)
        transfer_id = f"{request.request_id}-{uuid.uuid4().hex[:12]}"
        self._meta.sends.append(SendSpec(transfer_id, list(block_hashes), list(block_ids)))
        return HoldDecision(
            transfer_id,
            {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.engine_id,
                "remote_host": self.config.advertise_host,
                "remote_port": self.config.kv_port,
                "remote_transfer_id": transfer_id,
                "remote_num_blocks": len(block_ids),
            },
        )

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta, self._meta = self._meta, KVConnectorMetadata()
        return meta
