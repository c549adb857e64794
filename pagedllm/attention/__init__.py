"""Attention backends as objects: the per-step metadata contract (metadata.py), a layer's
features as one value (params.py), the KV layouts a backend reads (layouts.py), the
backends (torch_backend.py, reference.py, triton_backend.py) and the one place that picks
one by name (registry.py). See docs/architecture.md, "Attention"."""
