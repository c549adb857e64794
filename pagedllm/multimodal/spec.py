"""What a vision-language family declares about its image inputs (ModelFamily.image)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class ImageSpec:
    """How a family's prompts hold images. Its HF processor (saved with the checkpoint)
    expands each image placeholder of the prompt text into `image_token` runs, one run of
    `embeds_per_tile` tokens per tile of the image; the encoder's rows replace those tokens."""

    image_token: Callable[[Any], int]
    """HF config -> the id of the token each image embedding replaces."""
    embeds_per_tile: Callable[[Any], int]
    """HF config -> embeddings (placeholder tokens) per tile."""
    image_end_token: str | None = None
    """The token just before the last tile's run of each image (Idefics3's <global-img>): where
    one image's tiles end. None: every image is one tile."""
    placeholder: str = "<image>"
    """What a prompt text writes where an image goes (the chat template writes it too)."""
