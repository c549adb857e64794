"""Checkpoints by Hugging Face hub id (e.g. "Qwen/Qwen3-0.6B"), through huggingface_hub's cache.

As vLLM: the snapshot of the revision is downloaded into the cache where the machine reaches
the hub, and read from the cache alone under `HF_HUB_OFFLINE=1` (or `offline=True`), a clear
error naming the cache when it holds no snapshot of that revision. The cache is
`download_dir`, else `$HF_HUB_CACHE`, else huggingface_hub's default (~/.cache/huggingface/hub),
laid out as huggingface_hub does: `models--<org>--<name>/snapshots/<commit>/...`, with
`refs/<branch or tag>` holding the commit of a named revision.

Only what the loader reads is fetched: configs, safetensors weights and tokenizer files.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

# The files of a snapshot the loader reads (loader.py): config and generation config,
# safetensors (and their index), tokenizer files and chat templates.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
_TRUE = ("1", "ON", "YES", "TRUE")


def offline_from_env() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it, at call time (not at its import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE


def hub_cache_dir(download_dir: str | None = None) -> str:
    """The cache a hub id resolves in: download_dir, else $HF_HUB_CACHE, else the default."""
    if download_dir:
        return os.path.expanduser(download_dir)
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def is_hub_id(model: str) -> bool:
    """Whether `model` has the form of a hub repo id ("name" or "org/name")."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if model.startswith((".", "/", "~")) or model.endswith(".gguf"):
        return False
    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def hub_snapshot(
    repo_id: str,
    revision: str | None = None,
    download_dir: str | None = None,
    offline: bool | None = None,
) -> str:
    """The local directory of the repo's snapshot at `revision` (default: main), downloaded
    unless offline (None: from HF_HUB_OFFLINE). ValueError saying why when there is none."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = offline_from_env() if offline is None else offline
    cache_dir = hub_cache_dir(download_dir)
    where = f"revision {revision or 'main'} of {repo_id!r}"
    try:
        path = snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir, local_files_only=offline, allow_patterns=ALLOW_PATTERNS
        )
    except LocalEntryNotFoundError:
        how = "HF_HUB_OFFLINE=1: from the cache alone" if offline else "the hub could not be reached"
        raise ValueError(f"the hub cache {cache_dir} has no complete snapshot of {where} ({how})") from None
    except HfHubHTTPError as e:  # not found, gated, revision unknown
        raise ValueError(f"the hub has no {where} in reach: {e}") from None
    logger.info("%s: snapshot %s", where, path)
    return path
