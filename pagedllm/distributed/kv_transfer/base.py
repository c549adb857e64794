"""The KV connector interface, in the shape of vLLM's v1 ``KVConnectorBase`` (torch-free).

A connector has two halves living in the engine-core process:

- the **scheduler side** (``KVConnectorSchedulerBase``), called by the torch-free scheduler:
  how many of a waiting request's tokens can be loaded from a remote instance, what was
  allocated for them, whether a finished request's blocks must stay held for a transfer;
  each step it packs its decisions into a ``KVConnectorMetadata``;
- the **worker side** (``KVConnectorWorkerBase``), next to the KV tensors: it carries out the
  metadata (start loads into allocated blocks, serve held blocks) in the background and
  reports finished and failed transfers back as a ``KVConnectorOutput``.

Flow: a prefill instance (producer) computes a prompt, returns one token, and *holds* the
prompt's full blocks (``request_finished`` -> hold); its answer carries ``kv_transfer_params``
(where and what to pull). A decode instance (consumer) given those params allocates blocks,
pulls them (``start_load_kv``), and once ``get_finished`` reports the load, enters them into
its prefix cache under the same hashes and computes the rest of the prompt itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pagedllm.kv_backends.paged.kv_cache_utils import BlockHash
from pagedllm.request import Request


@dataclass(slots=True)
class LoadSpec:
    """Consumer: pull the blocks named by ``block_hashes`` into local ``block_ids``."""

    req_id: str
    transfer_id: str
    remote_host: str
    remote_port: int
    block_hashes: list[BlockHash]
    block_ids: list[int]
    """Same length as block_hashes: where each pulled block lands."""
    deadline: float | None = None
    """time.monotonic() after which the pull is given up (queued or in flight)."""


@dataclass(slots=True)
class SendSpec:
    """Producer: serve these held blocks under ``transfer_id`` until pulled or expired."""

    transfer_id: str
    block_hashes: list[BlockHash]
    block_ids: list[int]


@dataclass(slots=True)
class ReleaseSpec:
    """Consumer: tell a producer that a transfer will not be pulled (it frees the blocks)."""

    transfer_id: str
    remote_host: str
    remote_port: int


@dataclass
class KVConnectorMetadata:
    """Scheduler side -> worker side, once per step."""

    loads: list[LoadSpec] = field(default_factory=list)
    sends: list[SendSpec] = field(default_factory=list)
    releases: list[ReleaseSpec] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.sends or self.releases)


@dataclass
class KVConnectorOutput:
    """Worker side -> scheduler, once per step: transfers that ended since the last call."""

    finished_sending: set[str] = field(default_factory=set)
    """Transfer ids whose held blocks may be freed (pulled, released or expired)."""
    finished_recving: set[str] = field(default_factory=set)
    """Request ids whose blocks all arrived."""
    failed_recving: dict[str, str] = field(default_factory=dict)
    """Request id -> why its pull failed (its blocks hold no valid KV)."""

    def __bool__(self) -> bool:
        return bool(self.finished_sending or self.finished_recving or self.failed_recving)


class HoldDecision(NamedTuple):
    hold_id: str | None
    """Key under which the request's blocks stay held (None: free them now)."""
    kv_transfer_params: dict[str, Any] | None
    """Returned to the client: what a consumer needs to pull the blocks."""


class KVConnectorSchedulerBase(ABC):
    """The connector's scheduler half. Plain Python: the scheduler is torch-free."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` (local prefix hits) that can be loaded from a
        remote instance, a whole number of blocks, and whether the load is asynchronous
        (the request then waits for it outside the running batch)."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], block_hashes: list[BlockHash]
    ) -> None:
        """Blocks were allocated for the loadable tokens: ``block_ids[i]`` receives the
        block whose prefix-cache hash is ``block_hashes[i]``."""

    @abstractmethod
    def request_finished(
        self, request: Request, block_ids: list[int], block_hashes: list[BlockHash]
    ) -> HoldDecision:
        """``request`` finished; ``block_ids`` are its full, computed blocks (``block_hashes``
        their hashes). Decide whether they stay held for a remote pull."""

    def remote_wait_timeout_s(self) -> float | None:
        """How long a request may wait for its remote KV (None: no limit)."""
        return None

    def hold_limits(self) -> tuple[int | None, int | None]:
        """At most (prompts, blocks) held for remote pulls at once (None: no limit)."""
        return None, None

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata:
        """Everything decided since the last call, for the worker side."""


class KVConnectorWorkerBase(ABC):
    """The connector's worker half, next to the KV tensors."""

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Start this step's loads (into blocks that are allocated and not yet computed),
        register blocks to serve, send releases. Returns at once: transfers run in the
        background."""

    def wait_for_save(self) -> None:
        """Block until this step's saves are done. Producers here save nothing: held blocks
        are served in place, so there is nothing to wait for."""

    @abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """Transfers that finished or failed since the last call."""

    @abstractmethod
    def wait_for_transfers(self, timeout_s: float) -> None:
        """Sleep until some transfer ends or ``timeout_s`` passes (an idle engine waits here
        instead of spinning)."""

    def get_stats(self) -> dict[str, float]:
        """Counters since start: blocks/bytes sent and received, failures."""
        return {}

    def shutdown(self) -> None:
        """Stop background threads and close sockets."""
