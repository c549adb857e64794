"""Fault injection, so tests can drive the failure paths of a real server.

The engine's ``ObservabilityConfig.inject_fault`` (``--inject-fault``, defaulted from
``PAGEDLLM_INJECT_FAULT`` when the configuration is created), installed in each process by
``configure`` (the engine's builder, and the server's front end):
``"<site>:<marker>[@<n>][,...]"`` makes ``site`` raise
``InjectedFault`` for every request whose id contains ``marker`` (clients choose ids with the
``request_id`` field; the sequences of n > 1 and the beams of a beam search carry it too);
with ``@<n>``, from the n-th time that request passes the site on (a fault mid-way).
Sites, each a per-request processing point but ``core_step`` and ``utility``:

- ``detokenize``: front end, detokenizing one output of the request;
- ``grammar``: engine core, filling the request's structured-output token bitmask;
- ``sample``: model runner, applying the request's sampling parameters;
- ``propose``: model runner, proposing the request's speculative drafts;
- ``beam``: engine core, expanding the beams of a beam search (marker in the search's id);
- ``core_step``: engine core, before each step in which the request runs (fails the batch);
- ``add``: engine core, handling the message that adds the request (or beam search);
- ``utility``: engine core, handling a utility message; the marker matches the utility's name
  (``reset_prefix_cache``, ``kv_snapshot``) instead of a request id;
- ``kv_loader``: the KV connector's loader thread, taking the request's pull from its queue,
  outside the thread's guard: the thread dies (what /health must report).

Unconfigured, every check is one dict lookup. Lives at the package top so every layer may call it.
"""

from __future__ import annotations

from collections.abc import Iterable

SITES = ("detokenize", "grammar", "sample", "propose", "beam", "core_step", "add", "utility", "kv_loader")


class InjectedFault(RuntimeError):
    """Raised where a test asked for a fault."""


def _parse(spec: str | None) -> tuple[dict[str, str], dict[str, int]]:
    """(site -> marker, site -> the pass from which a marked request fails)."""
    faults: dict[str, str] = {}
    from_nth: dict[str, int] = {}
    for item in (spec or "").split(","):
        if not item:
            continue
        site, sep, marker = item.partition(":")
        marker, at, nth = marker.partition("@")
        if not sep or site not in SITES or not marker or (at and not nth.isdigit()):
            raise ValueError(
                f"inject_fault={spec!r}: expected '<site>:<marker>[@<n>]' items, site in {SITES}"
            )
        faults[site] = marker
        if at:
            from_nth[site] = int(nth)
    return faults, from_nth


def check(spec: str | None) -> None:
    """ValueError for a malformed spec (the configuration's check)."""
    _parse(spec)


def configure(spec: str | None) -> None:
    """Install ``spec`` in this process (None: no faults), forgetting the passes counted."""
    global _FAULTS, _FROM_NTH
    _FAULTS, _FROM_NTH = _parse(spec)
    _passes.clear()


_FROM_NTH: dict[str, int] = {}  # site -> the pass from which a marked request fails
_passes: dict[tuple[str, str], int] = {}  # (site, marked request id) -> passes so far
_FAULTS: dict[str, str] = {}  # site -> request id marker; set by configure


def _fires(site: str, marker: str, request_id: str) -> bool:
    if marker not in request_id:
        return False
    nth = _FROM_NTH.get(site)
    if nth is None:
        return True
    key = (site, request_id)
    _passes[key] = _passes.get(key, 0) + 1
    return _passes[key] >= nth


def maybe_raise(site: str, request_id: str) -> None:
    marker = _FAULTS.get(site)
    if marker is not None and _fires(site, marker, request_id):
        raise InjectedFault(f"injected fault at {site} for request {request_id}")


def maybe_raise_any(site: str, request_ids: Iterable[str]) -> None:
    """``maybe_raise`` for a batch: raises if any of the requests is marked."""
    marker = _FAULTS.get(site)
    if marker is not None:
        for request_id in request_ids:
            if _fires(site, marker, request_id):
                raise InjectedFault(f"injected fault at {site} for request {request_id}")
