"""Fault injection, so tests can drive the failure paths of a real server.

``PAGEDLLM_INJECT_FAULT="<site>:<marker>[,<site>:<marker>...]"`` makes ``site`` raise
``InjectedFault`` for every request whose id contains ``marker`` (clients choose ids with the
``request_id`` field; the sequences of n > 1 and the beams of a beam search carry it too).
Sites, each a per-request processing point but ``core_step``:

- ``detokenize``: front end, detokenizing one output of the request;
- ``grammar``: engine core, filling the request's structured-output token bitmask;
- ``sample``: model runner, applying the request's sampling parameters;
- ``propose``: model runner, proposing the request's speculative drafts;
- ``beam``: engine core, expanding the beams of a beam search (marker in the search's id);
- ``core_step``: engine core, before each step in which the request runs (fails the batch).

Unset, every check is one dict lookup. Lives at the package top so every layer may call it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

SITES = ("detokenize", "grammar", "sample", "propose", "beam", "core_step")


class InjectedFault(RuntimeError):
    """Raised where a test asked for a fault."""


def _parse(spec: str | None) -> dict[str, str]:
    faults: dict[str, str] = {}
    for item in (spec or "").split(","):
        if not item:
            continue
        site, sep, marker = item.partition(":")
        if not sep or site not in SITES or not marker:
            raise ValueError(f"PAGEDLLM_INJECT_FAULT={spec!r}: expected '<site>:<marker>' items, site in {SITES}")
        faults[site] = marker
    return faults


_FAULTS = _parse(os.environ.get("PAGEDLLM_INJECT_FAULT"))


def maybe_raise(site: str, request_id: str) -> None:
    marker = _FAULTS.get(site)
    if marker is not None and marker in request_id:
        raise InjectedFault(f"injected fault at {site} for request {request_id}")


def maybe_raise_any(site: str, request_ids: Iterable[str]) -> None:
    """``maybe_raise`` for a batch: raises if any of the requests is marked."""
    marker = _FAULTS.get(site)
    if marker is not None:
        for request_id in request_ids:
            if marker in request_id:
                raise InjectedFault(f"injected fault at {site} for request {request_id}")
