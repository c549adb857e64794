"""The messages between the front end (``core_client.py``) and the engine-core process
(``core_proc.py``): two ZMQ PUSH/PULL sockets, each message one pickle (protocol 5) of
``(kind, payload)``.

- front end -> core: ``add`` (a Request), ``add_beam_search`` ((request id, prompt token ids,
  BeamSearchParams)), ``abort`` ((request ids, stopped)),
  ``pause`` / ``resume`` (request ids: a stalled client's requests leave the batch / rejoin it), ``reset_prefix_cache``,
  ``kv_snapshot`` (the dashboard's KVSnapshot, taken between steps), ``shutdown``;
- core -> front end: ``ready`` (ReadyInfo) or ``failed`` (a message) once at start-up, then
  ``outputs`` (CoreOutputs: engine outputs and, periodically, stats), ``utility``
  ((name, result, error): error is None, or "Type: message" when the utility raised).

A message that raises in the core fails its sender alone: an ``add`` answers with an
``outputs`` entry for that request carrying ``error``; a utility with its error.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.core.outputs import EngineCoreOutput, SchedulerStats


@dataclass
class ReadyInfo:
    """What the front end needs from the loaded engine: it never loads the weights itself."""

    model_config: ModelConfig
    config: EngineConfig
    tokenizer: Any
    num_total_blocks: int
    """Usable KV blocks (the null block excluded)."""
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    """The checkpoint's sampling defaults (engine/generation_config.py)."""


@dataclass
class CoreStats:
    scheduler_stats: SchedulerStats
    num_free_blocks: int
    num_total_blocks: int
    queue_times: list[float] = field(default_factory=list)
    """Seconds from arrival to first scheduling, for requests first scheduled since the last stats."""
    kv_transfer: dict[str, float] | None = None
    """Disaggregated prefill: the KV connector's counters since start (None without one)."""
    iteration_tokens: list[int] = field(default_factory=list)
    """Tokens scheduled by each engine step since the last stats (steps with work only)."""


@dataclass
class CoreOutputs:
    outputs: list[EngineCoreOutput]
    stats: CoreStats | None = None


def dumps(kind: str, payload: Any = None) -> bytes:
    return pickle.dumps((kind, payload), protocol=5)


def loads(data: bytes) -> tuple[str, Any]:
    return pickle.loads(data)
