"""The image features a request carries from the front end to the runner (plain data, no
torch: the control plane keys its prefix-cache hashes on them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class MultiModalFeature:
    """One image of a prompt, preprocessed."""

    identifier: str
    """sha256 (hex) of the preprocessed pixels and their shape: the encoder cache's key and the
    image's part of the prefix-cache key."""
    positions: Any
    """numpy int64 [num_embeds]: the prompt positions this image's embeddings replace, in
    order (a tiled image's runs are interleaved with row markers)."""
    pixel_values: Any
    """numpy float32 [num_tiles, C, H, W]: the vision encoder's input."""

    @property
    def offset(self) -> int:
        """The first prompt position of the image."""
        return int(self.positions[0])

    @property
    def end(self) -> int:
        """One past the last prompt position of the image."""
        return int(self.positions[-1]) + 1

    @property
    def num_embeds(self) -> int:
        return len(self.positions)


def mm_block_keys(features: list[MultiModalFeature] | None, block_size: int) -> dict[int, tuple] | None:
    """The prefix-cache extra key of each block that holds image positions (None without
    images): the hashes and offsets of the images it overlaps, as vLLM keys blocks. Blocks
    before the first image share like text; from an image's first block on, requests with
    the same text and different images never share a block (the hashes chain)."""
    if not features:
        return None
    keys: dict[int, list[tuple[str, int]]] = {}
    for f in features:
        for block in range(f.offset // block_size, (f.end - 1) // block_size + 1):
            keys.setdefault(block, []).append((f.identifier, f.offset))
    return {block: ("mm", tuple(images)) for block, images in keys.items()}
