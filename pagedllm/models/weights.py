"""Reading HF safetensors checkpoints (single file or sharded with an index)."""

from __future__ import annotations

import json
import os
from typing import Iterator

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's safetensors files: those the index names, else every *.safetensors."""
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not names:
        raise ValueError(
            f"no *.safetensors weights in {model_dir!r} (only safetensors checkpoints are "
            "supported, not pytorch_model.bin)"
        )
    return [os.path.join(model_dir, n) for n in names]


def iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of every file, one tensor in memory at a time."""
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
