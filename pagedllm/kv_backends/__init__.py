"""KV cache backends, one package each, chosen by name through this registry.

A backend has a control-plane side (a ``KVManager``, core/kv_manager.py: what the scheduler
allocates, frees, forks and looks up), a worker-side ``KVCacheWorker`` (worker/kv_worker.py:
the KV tensors on a device and each step's attention metadata), the dashboard's view of its
memory, and the engine-argument checks of what it cannot do; ``KVBackend`` (base.py) ties
them together. Code outside a backend's package reaches it only through ``get_kv_backend``.

Registration is by place: every subpackage of this package is a backend, named as the
subpackage, whose ``__init__`` defines ``BACKEND`` (a ``KVBackend``). Adding a backend is
adding its package; nothing here or elsewhere lists the names. This module imports no
backend (config.py reads ``KV_BACKEND_NAMES``); a backend's package is imported on first use.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.kv_backends.base import KVBackend

KV_BACKEND_NAMES = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if m.ispkg))


def get_kv_backend(name: str) -> KVBackend:
    """The backend registered as ``name``; ValueError naming the choices otherwise."""
    if name not in KV_BACKEND_NAMES:
        raise ValueError(f"kv_cache_backend={name!r} is not one of {', '.join(KV_BACKEND_NAMES)}")
    return importlib.import_module(f"{__name__}.{name}").BACKEND
