"""KVTransferConfig: the `--kv-transfer-config` JSON of `pagedllm serve` (torch-free)."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import re
from dataclasses import dataclass, field, fields
from typing import Any, Literal

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
_ROLES = ("kv_producer", "kv_consumer", "kv_both")
_POLICIES = ("recompute", "fail")
_EXTRA_KEYS = ("trusted_producers", "shared_secret")
_LOOPBACK_NAMES = ("localhost", "localhost.localdomain")
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def is_host(value: object) -> bool:
    """Whether ``value`` is a bare host: an IPv4/IPv6 address or a DNS name (no scheme,
    port, path, user or spaces)."""
    if not isinstance(value, str) or not 0 < len(value) <= 253:
        return False
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        pass
    return all(_HOST_LABEL.match(label) for label in value.rstrip(".").split("."))


def is_port(value: object) -> bool:
    """Whether ``value`` is a TCP port number (an int, not a bool, in 1..65535)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536


def is_loopback(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _parse_producer(entry: object) -> tuple[str, int | None]:
    """``"host"`` (any port) or ``"host:port"`` / ``"[v6]:port"`` of trusted_producers."""
    if not isinstance(entry, str):
        raise ValueError(f"kv_connector_extra_config.trusted_producers: {entry!r} is not a 'host[:port]' string")
    host, port = entry, None
    if entry.startswith("["):  # [v6]:port
        close = entry.find("]")
        host, rest = entry[1:close], entry[close + 1:]
        if close < 0 or (rest and not rest.startswith(":")):
            raise ValueError(f"kv_connector_extra_config.trusted_producers: {entry!r} is not 'host[:port]'")
        port = rest[1:] or None
    elif entry.count(":") == 1:
        host, port = entry.split(":")
    if port is not None:
        if not port.isdigit() or not is_port(int(port)):
            raise ValueError(f"kv_connector_extra_config.trusted_producers: {entry!r} has no valid port")
        port = int(port)
    if not is_host(host):
        raise ValueError(f"kv_connector_extra_config.trusted_producers: {entry!r} is not a host")
    return host.lower(), port


def sign_transfer(secret: str, host: str, port: int, transfer_id: str, num_blocks: int) -> str:
    """The producer's HMAC-SHA256 over what a consumer will act on (hex)."""
    message = json.dumps([host, port, transfer_id, num_blocks], separators=(",", ":")).encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


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
    kv_remote_wait_timeout_s: float = 30.0
    """A consumer's request waits at most this long for its prompt's KV (queued pulls
    included); then it fails with a 503 and its blocks are freed."""
    kv_max_held_transfers: int = 256
    """The producer holds at most this many prompts for a remote pull at once; beyond it a
    prefill answers without kv_transfer_params (the decode instance recomputes)."""
    kv_max_held_blocks: int | None = None
    """The producer holds at most this many KV blocks for remote pulls at once (default:
    half of its KV pool)."""
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict, hash=False)
    """Trust (docs/security.md): ``trusted_producers``, a list of "host" or "host:port"
    a consumer pulls from (default: loopback only); ``shared_secret``, a key producers sign
    their kv_transfer_params with (HMAC-SHA256) and consumers require the signature of."""

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
        for name in ("kv_hold_timeout_s", "kv_transfer_timeout_s", "kv_send_timeout_s", "kv_remote_wait_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}={value!r} must be > 0 seconds")
        for name in ("kv_max_held_transfers", "kv_max_held_blocks"):
            value = getattr(self, name)
            if value is None and name == "kv_max_held_blocks":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an integer >= 0")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise ValueError("kv_connector_extra_config must be a JSON object")
        unknown = sorted(set(extra) - set(_EXTRA_KEYS))
        if unknown:
            raise ValueError(f"kv_connector_extra_config has unknown keys {unknown}; known: {list(_EXTRA_KEYS)}")
        producers = extra.get("trusted_producers", [])
        if not isinstance(producers, list):
            raise ValueError("kv_connector_extra_config.trusted_producers must be a list of 'host[:port]' strings")
        object.__setattr__(self, "_trusted", tuple(_parse_producer(p) for p in producers))
        secret = extra.get("shared_secret")
        if secret is not None and (not isinstance(secret, str) or len(secret) < 16):
            raise ValueError("kv_connector_extra_config.shared_secret must be a string of at least 16 characters")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def advertise_host(self) -> str:
        return self.kv_advertise_host or self.kv_host

    @property
    def shared_secret(self) -> str | None:
        return self.kv_connector_extra_config.get("shared_secret")

    def trusts(self, host: str, port: int) -> bool:
        """Whether a consumer may pull from ``host:port``: listed in trusted_producers, or
        (no list given) a loopback address."""
        trusted = self._trusted  # type: ignore[attr-defined]
        if not trusted:
            return is_loopback(host)
        host = host.lower()
        return any(h == host and (p is None or p == port) for h, p in trusted)

    def sign(self, host: str, port: int, transfer_id: str, num_blocks: int) -> str | None:
        secret = self.shared_secret
        return None if secret is None else sign_transfer(secret, host, port, transfer_id, num_blocks)

    def signature_ok(self, params: dict[str, Any]) -> bool:
        """Whether params carry a valid ``remote_signature`` from a producer sharing our secret."""
        expected = self.sign(params["remote_host"], params["remote_port"], params["remote_transfer_id"],
                             params["remote_num_blocks"])
        given = params.get("remote_signature")
        return expected is not None and isinstance(given, str) and hmac.compare_digest(expected, given)

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
