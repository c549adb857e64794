"""Model families by HF architecture name and by GGUF architecture, read from the
declarations of the model files (models/family.py).

The first lookup imports every module of this package once and collects each one's
`FAMILIES`; a new model file is found without being listed anywhere.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from torch import nn

import pagedllm.models as _models_package
from pagedllm.models.family import ModelFamily


@functools.lru_cache(maxsize=1)
def families() -> tuple[ModelFamily, ...]:
    """Every declared family, in module-name order."""
    found: list[ModelFamily] = []
    for info in sorted(pkgutil.iter_modules(_models_package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{_models_package.__name__}.{info.name}")
        found.extend(getattr(module, "FAMILIES", ()))
    return tuple(found)


@functools.lru_cache(maxsize=1)
def _by_architecture() -> dict[str, ModelFamily]:
    table: dict[str, ModelFamily] = {}
    for family in families():
        for architecture in family.architectures:
            assert architecture not in table, f"{architecture} is declared twice"
            table[architecture] = family
    return table


def supported_architectures() -> list[str]:
    return sorted(_by_architecture())


def family_of(architecture: str) -> ModelFamily:
    """The family of an HF architecture name; ValueError naming the supported ones."""
    family = _by_architecture().get(architecture)
    if family is None:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; "
            f"supported: {', '.join(supported_architectures())}"
        )
    return family


def resolve_model_class(architecture: str) -> type[nn.Module]:
    """The model class for an HF architecture name; ValueError naming the supported ones."""
    return family_of(architecture).model_class


def supported_gguf_architectures() -> list[str]:
    return sorted(f.gguf.architecture for f in families() if f.gguf is not None)


def gguf_family(gguf_architecture: str) -> ModelFamily:
    """The family whose GGUF files name `gguf_architecture`; ValueError naming the supported."""
    for family in families():
        if family.gguf is not None and family.gguf.architecture == gguf_architecture:
            return family
    raise ValueError(
        f"GGUF architecture {gguf_architecture!r} is not supported; "
        f"supported: {', '.join(supported_gguf_architectures())}"
    )


def tensor_parallel_families() -> list[str]:
    return [f.name for f in families() if f.supports_tensor_parallel]
