"""Model definitions (forward-only, HF parameter names), the registry and the loader."""
