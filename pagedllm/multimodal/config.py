"""Image inputs' settings (vLLM's --limit-mm-per-prompt, --allowed-local-media-path,
--allowed-media-domains) and the bounds on what a request may send."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

MODALITIES = ("image",)


@dataclass(frozen=True)
class MultiModalConfig:
    """Where images may come from and how many and how large they may be."""

    limit_per_prompt: Mapping[str, int] = field(default_factory=dict)
    """Most items of a modality in one prompt, e.g. {"image": 2}; a modality not named: no cap."""
    allowed_local_media_path: str | None = None
    """file:// image URLs are read only under this directory (None: refused)."""
    allowed_media_domains: tuple[str, ...] = ()
    """http(s) image URLs are fetched only from these hosts (empty: refused)."""
    media_fetch_timeout_s: float = 10.0
    """The whole fetch of one http(s) image, connect to last byte."""
    max_image_bytes: int = 20 * 2**20
    """The largest encoded image accepted (a data URL's decoded bytes, a file, a download)."""
    max_image_pixels: int = 8192 * 8192
    """The most pixels an image may declare: checked from its header, before it is decoded
    (a decompression bomb is refused without the memory)."""
    encoder_cache_size: int | None = None
    """Embedding rows the runner's encoder cache keeps (None: max_num_batched_tokens, as vLLM,
    and never less than the largest image)."""

    def __post_init__(self) -> None:
        for modality, limit in self.limit_per_prompt.items():
            if modality not in MODALITIES:
                raise ValueError(f"limit_mm_per_prompt names {modality!r}; supported: {', '.join(MODALITIES)}")
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
                raise ValueError(f"limit_mm_per_prompt[{modality!r}]={limit!r} must be a non-negative integer")
        if self.media_fetch_timeout_s <= 0:
            raise ValueError(f"media_fetch_timeout_s={self.media_fetch_timeout_s} must be positive")
