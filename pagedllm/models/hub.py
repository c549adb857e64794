"""Checkpoints by Hugging Face hub id (e.g. "Qwen/Qwen3-0.6B"), through huggingface_hub's cache.

As vLLM: the snapshot of the revision is downloaded into the cache where the machine reaches
the hub, and read from the cache alone under `HF_HUB_OFFLINE=1` (or `offline=True`), a clear
error naming the cache when it holds no snapshot of that revision. The cache is
`download_dir`, else `$HF_HUB_CACHE`, else huggingface_hub's default (~/.cache/huggingface/hub),
laid out as huggingface_hub does: `models--<org>--<name>/snapshots/<commit>/...`, with
`refs/<branch or tag>` holding the commit of a named revision.

Only what the loader reads is fetched: configs, safetensors weights and tokenizer files; for
a GGUF repo named with a quant tag or a file ("org/name:Q4_K_M", "org/name:NAME.gguf"), only
that file (and its splits).
"""

from __future__ import annotations

import logging
import os
import re

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

    offline = offline_from_env() if offline is None else offline
    cache_dir = hub_cache_dir(download_dir)
    where = f"revision {revision or 'main'} of {repo_id!r}"
    path = _snapshot(repo_id, revision, cache_dir, offline, ALLOW_PATTERNS, where, "complete snapshot")
    logger.info("%s: snapshot %s", where, path)
    return path


# A tag that names one file of a repo: "NAME.gguf" (--hf-file), else a quant type ("Q4_K_M").
_SPLIT_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def split_quant_tag(model: str) -> tuple[str, str] | None:
    """("org/name", tag) for "org/name:TAG" (llama-server's -hf repo:quant, vLLM's
    repo_id:quant_type; TAG a quant type or a file name), else None."""
    repo, sep, tag = model.rpartition(":")
    if not sep or not tag or not is_hub_id(repo):
        return None
    return repo, tag


def hub_gguf_file(
    repo_id: str, tag: str, revision: str | None = None, download_dir: str | None = None, offline: bool | None = None
) -> str:
    """The local path of the repo's GGUF file for `tag` (its first split, all splits fetched):
    a file name (NAME.gguf, as given to --hf-file) or a quant type matched case-insensitively
    as a word of the file's path ("Q4_K_M" in "Qwen3-8B-Q4_K_M.gguf" or in
    "Q4_K_M/Qwen3-8B-Q4_K_M-00001-of-00002.gguf"). Only those files are downloaded (none
    under HF_HUB_OFFLINE=1). ValueError listing the repo's GGUF files when none or several match."""

    offline = offline_from_env() if offline is None else offline
    cache_dir = hub_cache_dir(download_dir)
    where = f"revision {revision or 'main'} of {repo_id!r}"
    every_split = _SPLIT_RE.sub(r"-*-of-\2.gguf", tag)  # a first split's name fetches all
    if tag.endswith(".gguf"):
        patterns = [every_split, f"*/{every_split}"]
    else:
        patterns = [f"*{tag}*.gguf", f"*{tag.lower()}*.gguf", f"*{tag.upper()}*.gguf"]
    snapshot = _snapshot(repo_id, revision, cache_dir, offline, patterns, where, "snapshot")
    files = sorted(
        os.path.relpath(os.path.join(d, n), snapshot)
        for d, _, names in os.walk(snapshot, followlinks=True)
        for n in names
        if n.endswith(".gguf")
    )
    if tag.endswith(".gguf"):
        matches = [f for f in files if f == tag or os.path.basename(f) == tag]
    else:
        word = re.compile(rf"(^|[-._/]){re.escape(tag)}([-._/]|$)", re.IGNORECASE)
        matches = [f for f in files if word.search(f[: -len(".gguf")]) and "mmproj" not in f.lower()]
    firsts = [f for f in matches if (m := _SPLIT_RE.search(f)) is None or int(m.group(1)) == 1]
    if len(firsts) != 1:
        found = "none" if not firsts else "several: " + ", ".join(firsts)
        raise ValueError(
            f"{where} has {found} matching {tag!r} (its GGUF files in {snapshot}: "
            f"{', '.join(files) or 'none'}); name one with --hf-file NAME.gguf or repo:NAME.gguf"
        )
    path = os.path.join(snapshot, firsts[0])
    logger.info("%s, %s: %s", where, tag, path)
    return path


def _snapshot(
    repo_id: str, revision: str | None, cache_dir: str, offline: bool, patterns: list[str], where: str, what: str
) -> str:
    """snapshot_download of the files matching `patterns`; ValueError naming the cache or the
    hub's answer (not found, gated, revision unknown) where it cannot be had."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir, local_files_only=offline, allow_patterns=patterns
        )
    except LocalEntryNotFoundError:
        how = "HF_HUB_OFFLINE=1: from the cache alone" if offline else "the hub could not be reached"
        raise ValueError(f"the hub cache {cache_dir} has no {what} of {where} ({how})") from None
    except HfHubHTTPError as e:  # not found, gated, revision unknown
        raise ValueError(f"the hub has no {where} in reach: {e}") from None
