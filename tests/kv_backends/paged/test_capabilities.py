"""The paged manager's declared capabilities, which callers ask for instead of downcasting."""

from __future__ import annotations

from pagedllm.kv_backends import get_kv_backend
from pagedllm.kv_backends.paged.manager import KVCacheManager


def test_paged_manager_declares_kv_transfer_and_delayed_caching():
    kv = KVCacheManager(num_blocks=8, block_size=4, max_model_len=32)
    caps = kv.capabilities
    assert caps.prefix_caching and caps.forks and caps.delayed_caching and caps.kv_transfer
    assert kv.kv_transfer() is kv


def test_backends_read_their_managers_declaration():
    """A backend's supports_* figures are its manager's capabilities, not a second list."""
    for name in ("paged", "vattention"):
        backend = get_kv_backend(name)
        caps = backend.capabilities
        assert (backend.supports_prefix_caching, backend.supports_forks, backend.supports_kv_transfer) == (
            caps.prefix_caching, caps.forks, caps.kv_transfer
        )
    assert not get_kv_backend("vattention").supports_kv_transfer
    assert get_kv_backend("paged").supports_kv_transfer
