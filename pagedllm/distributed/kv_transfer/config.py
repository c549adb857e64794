"""KVTransferConfig: the `--kv-transfer-config` JSON of `pagedllm serve` (torch-free)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Literal

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
_ROLES = ("kv_producer", "kv_consumer", "kv_both")
_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class KVTransferConfig:
    """How this instance takes part in disaggregated prefill/decode."""

    kv_role: KVRole
    """kv_producer (prefill: holds and serves prompt KV), kv_consumer (decode: pulls it), kv_both."""
    kv_connector: str = "ZmqConnector"
    """The connector implementation (only ZmqConnector: pyzmq over TCP)."""
    kv_host: str = "127.0.0.1"
    """Address the producer's KV server binds."""
    kv_port: int = 14579
    """TCP port of the producer's KV server."""
    kv_advertise_host: str | None = None
    """Host the producer tells consumers to pull from (default: kv_host; set it when binding 0.0.0.0)."""
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    """When a pull fails (producer gone, timeout, blocks no longer held): recompute the
    prompt locally, or fail the request with a 503."""
    kv_hold_timeout_s: float = 120.0
    """The producer frees blocks held for a transfer that nobody pulled within this time."""
    kv_transfer_timeout_s: float = 10.0
    """A consumer gives up on a pull that got no answer within this time."""
    kv_send_timeout_s: float = 60.0
    """The producer aborts answers to pulls still unsent after this long (a consumer stopped or
    unreachable): it reopens its KV socket, which drops every answer in flight, and frees their
    blocks once zmq has let go of them."""

    def __post_init__(self) -> None:
        if self.kv_role not in _ROLES:
            raise ValueError(f"kv_role={self.kv_role!r} must be one of {', '.join(_ROLES)}")
        if self.kv_connector != "ZmqConnector":
            raise ValueError(f"kv_connector={self.kv_connector!r} is unknown; the one available is 'ZmqConnector'")
        if not 0 < self.kv_port < 65536:
            raise ValueError(f"kv_port={self.kv_port} must be a TCP port (1..65535)")
        if self.kv_load_failure_policy not in _POLICIES:
            raise ValueError(
                f"kv_load_failure_policy={self.kv_load_failure_policy!r} must be 'recompute' or 'fail'"
            )
        for name in ("kv_hold_timeout_s", "kv_transfer_timeout_s", "kv_send_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0 seconds")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def advertise_host(self) -> str:
        return self.kv_advertise_host or self.kv_host

    @classmethod
    def from_cli(cls, value: str | dict[str, Any]) -> KVTransferConfig:
        """Parse the JSON object of `--kv-transfer-config`; unknown keys are an error."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--kv-transfer-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("--kv-transfer-config must be a JSON object, e.g. '{\"kv_role\": \"kv_producer\"}'")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"--kv-transfer-config has unknown keys {unknown}; known: {sorted(known)}")
        if "kv_role" not in value:
            raise ValueError("--kv-transfer-config needs kv_role: kv_producer, kv_consumer or kv_both")
        return cls(**value)
