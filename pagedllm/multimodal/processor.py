"""Prompt text + images -> prompt token ids with the placeholders expanded, and one
MultiModalFeature per image (its pixels, hash and prompt positions).

The checkpoint's own HF processor does the expansion and the pixel preprocessing (resize,
tiles, normalization), so the prompt is token for token the one HF's model sees. Blocking:
the server calls it on a worker thread, never on the event loop."""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import numpy as np

from pagedllm.multimodal.config import MultiModalConfig
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.multimodal.media import MediaError
from pagedllm.multimodal.spec import ImageSpec


class ImageProcessor:
    """A vision-language model's image preprocessing (its family's ImageSpec over the HF
    processor saved with the checkpoint)."""

    def __init__(self, model_dir: str, hf_config: Any, spec: ImageSpec, config: MultiModalConfig) -> None:
        from transformers import AutoProcessor

        self.hf = AutoProcessor.from_pretrained(model_dir)
        # One call at a time: the processor's fast tokenizer refuses concurrent use from
        # several threads ("Already borrowed") and the server preprocesses on worker threads.
        self._lock = threading.Lock()
        self.spec = spec
        self.config = config
        self.image_token_id = spec.image_token(hf_config)
        self.embeds_per_tile = spec.embeds_per_tile(hf_config)
        tok = self.hf.tokenizer
        self.image_end_id = None if spec.image_end_token is None else tok.convert_tokens_to_ids(spec.image_end_token)

    def check_count(self, num_images: int) -> None:
        limit = self.config.limit_per_prompt.get("image")
        if limit is not None and num_images > limit:
            raise ValueError(
                f"the prompt has {num_images} images, more than this server's limit of {limit} "
                "(--limit-mm-per-prompt)")

    def process(
        self, text: str, images: list[Any], add_special_tokens: bool = True
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """(prompt token ids, one feature per image, in prompt order). The text writes
        spec.placeholder once per image. ValueError (MediaError for a bad image) naming the
        problem."""
        self.check_count(len(images))
        num_placeholders = text.count(self.spec.placeholder)
        if num_placeholders != len(images):
            raise ValueError(
                f"the prompt has {num_placeholders} image placeholders ({self.spec.placeholder!r}) but "
                f"{len(images)} images were given")
        for image in images:
            _check_pil(image, self.config)
        try:
            with self._lock:
                out = self.hf(text=[text], images=[images], return_tensors="np",
                              add_special_tokens=add_special_tokens)
        except (ValueError, OSError) as e:
            raise MediaError(f"the image could not be preprocessed: {e}") from None
        ids = np.asarray(out["input_ids"][0], dtype=np.int64)
        pixels = np.asarray(out["pixel_values"][0], dtype=np.float32)  # [tiles, C, H, W], padded
        mask = out.get("pixel_attention_mask")
        return ids.tolist(), self._features(ids, pixels, None if mask is None else np.asarray(mask[0]), len(images))

    def _features(
        self, ids: np.ndarray, pixels: np.ndarray, mask: np.ndarray | None, num_images: int
    ) -> list[MultiModalFeature]:
        """Group the image-token runs into tiles of embeds_per_tile, tiles into images (an
        image ends with the tile after its end marker), and pair them with pixel tiles."""
        positions = np.flatnonzero(ids == self.image_token_id)
        per_tile = self.embeds_per_tile
        assert len(positions) % per_tile == 0, (len(positions), per_tile)
        tile_starts = positions[::per_tile]
        if self.image_end_id is None:
            ends = np.ones(len(tile_starts), dtype=bool)
        else:
            ends = ids[tile_starts - 1] == self.image_end_id
        assert int(ends.sum()) == num_images, (int(ends.sum()), num_images)
        features, first = [], 0
        for last in np.flatnonzero(ends):
            tiles = pixels[first : last + 1]
            if mask is not None and not mask[first : last + 1].all():
                raise MediaError("the image preprocessing left padded tiles, which this model cannot encode")
            pos = positions[first * per_tile : (last + 1) * per_tile]
            features.append(MultiModalFeature(_pixel_hash(tiles), pos, np.ascontiguousarray(tiles)))
            first = last + 1
        return features


def _check_pil(image: Any, config: MultiModalConfig) -> None:
    from PIL import Image

    from pagedllm.multimodal.media import check_image_size

    if not isinstance(image, Image.Image):
        raise MediaError(f"an image must be a PIL.Image.Image, got {type(image).__name__}")
    check_image_size(image.size, config)


def _pixel_hash(tiles: np.ndarray) -> str:
    h = hashlib.sha256()
    h.update(repr((tiles.dtype.str, tiles.shape)).encode())
    h.update(tiles.tobytes())
    return h.hexdigest()


def image_processor_for(model_config: Any, config: MultiModalConfig) -> ImageProcessor | None:
    """The model's image processor, or None for a text-only model."""
    if model_config.multimodal_dir is None:
        return None
    from transformers import AutoConfig

    from pagedllm.models.registry import family_of

    spec = family_of(model_config.architecture).image
    assert spec is not None
    hf_config = AutoConfig.from_pretrained(model_config.multimodal_dir)
    return ImageProcessor(model_config.multimodal_dir, hf_config, spec, config)
