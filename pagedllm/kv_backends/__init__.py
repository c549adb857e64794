"""KV cache backends, one package each, chosen by name through this registry.

A backend has a control-plane side (a ``KVManager``, core/kv_manager.py: what the scheduler
allocates, frees, forks and looks up), a worker-side ``KVCacheWorker`` (worker/kv_worker.py:
the KV tensors on a device and each step's attention metadata), the dashboard's view of its
memory, and the engine-argument checks of what it cannot do; ``KVBackend`` (base.py) ties
them together. Code outside a backend's package reaches it only through ``get_kv_backend``.

This module imports nothing (config.py reads ``KV_BACKEND_NAMES``); a backend's package is
imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.kv_backends.base import KVBackend

_MODULES = {
    "paged": "pagedllm.kv_backends.paged",
    "vattention": "pagedllm.kv_backends.vattention",
}
KV_BACKEND_NAMES = tuple(_MODULES)


def get_kv_backend(name: str) -> KVBackend:
    """The backend registered as ``name``; ValueError naming the choices otherwise."""
    if name not in _MODULES:
        raise ValueError(f"kv_cache_backend={name!r} is not one of {', '.join(KV_BACKEND_NAMES)}")
    return importlib.import_module(_MODULES[name]).BACKEND
