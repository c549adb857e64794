"""Fault injection, so tests can drive the failure paths of a real server.

``PAGEDLLM_INJECT_FAULT="<site>:<marker>[,<site>:<marker>...]"`` makes ``site`` raise
``InjectedFault`` for every request whose id contains ``marker`` (clients choose ids with the
``request_id`` field).
Sites: ``detokenize`` (front end, per output of the request) and ``core_step`` (engine core,
before each step in which the request is running). Unset, every check is one dict lookup.
"""

from __future__ import annotations

import os

SITES = ("detokenize", "core_step")


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
