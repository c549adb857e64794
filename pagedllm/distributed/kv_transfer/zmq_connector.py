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
import time
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
from pagedllm.distributed.kv_transfer.config import KVTransferConfig, is_host, is_port
from pagedllm.request import Request, RequestStatus

logger = logging.getLogger(__name__)

_REMOTE_KEYS = ("remote_host", "remote_port", "remote_transfer_id", "remote_num_blocks")
_MAX_ID_CHARS = 256
_WORKER_GRACE_S = 1.0
_FLAGS = ("do_remote_prefill", "do_remote_decode")


def validate_kv_transfer_params(params: object, config: KVTransferConfig | None = None) -> None:
    """Raise ValueError (a 400 at the server) unless ``params`` is a well-formed request field
    and, given this instance's ``config``, one it may act on: a pull only from a producer it
    trusts (docs/security.md)."""
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be a JSON object")
    for flag in _FLAGS:
        if params.get(flag) is not None and not isinstance(params[flag], bool):
            raise ValueError(f"kv_transfer_params.{flag} must be true or false")
    if not params.get("do_remote_prefill"):
        return
    missing = [k for k in _REMOTE_KEYS if params.get(k) is None]
    if missing:
        raise ValueError(
            f"kv_transfer_params with do_remote_prefill=true needs {', '.join(missing)} "
            "(pass on the kv_transfer_params of the prefill instance's response)"
        )
    if not is_host(params["remote_host"]):
        raise ValueError("kv_transfer_params.remote_host must be a bare host name or IP address")
    if not is_port(params["remote_port"]):
        raise ValueError("kv_transfer_params.remote_port must be an integer in 1..65535")
    num_blocks = params["remote_num_blocks"]
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
        raise ValueError("kv_transfer_params.remote_num_blocks must be an integer >= 0")
    for key in ("remote_transfer_id", "remote_engine_id"):
        value = params.get(key)
        if value is not None and (not isinstance(value, str) or not 0 < len(value) <= _MAX_ID_CHARS
                                  or not value.isprintable()):
            raise ValueError(f"kv_transfer_params.{key} must be a printable string of 1..{_MAX_ID_CHARS} characters")
    if config is None:
        return
    where = f"{params['remote_host']}:{params['remote_port']}"
    if config.shared_secret is not None and not config.signature_ok(params):
        raise ValueError(f"kv_transfer_params: no valid remote_signature for the transfer from {where} "
                         "(pass on the prefill instance's kv_transfer_params unchanged)")
    if (config.shared_secret is None or config.kv_connector_extra_config.get("trusted_producers")) and not (
        config.trusts(params["remote_host"], params["remote_port"])
    ):
        raise ValueError(f"kv_transfer_params: {where} is not a trusted prefill instance "
                         "(kv_connector_extra_config.trusted_producers)")


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
        try:  # checked at the API; again here for every other way in (the offline engine)
            validate_kv_transfer_params(params, self.config)
        except ValueError as e:
            logger.warning("request %s: %s; its prompt is computed here", request.request_id, e)
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
                # A little after the scheduler's own deadline, which fails the request first.
                deadline=time.monotonic() + self.config.kv_remote_wait_timeout_s + _WORKER_GRACE_S,
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
        transfer_id = f"{request.request_id[:64]}-{uuid.uuid4().hex}"
        self._meta.sends.append(SendSpec(transfer_id, list(block_hashes), list(block_ids)))
        host, port = self.config.advertise_host, self.config.kv_port
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": host,
            "remote_port": port,
            "remote_transfer_id": transfer_id,
            "remote_num_blocks": len(block_ids),
        }
        signature = self.config.sign(host, port, transfer_id, len(block_ids))
        if signature is not None:
            params["remote_signature"] = signature
        return HoldDecision(transfer_id, params)

    def remote_wait_timeout_s(self) -> float | None:
        return self.config.kv_remote_wait_timeout_s

    def hold_limits(self) -> tuple[int | None, int | None]:
        return self.config.kv_max_held_transfers, self.config.kv_max_held_blocks

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta, self._meta = self._meta, KVConnectorMetadata()
        return meta
