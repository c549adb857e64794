"""A tiny random Idefics3 (SmolVLM) checkpoint, its HF reference, test images."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_idefics3_dir(tmp_path_factory, default_tokenizer):
    from tests.multimodal.tiny_idefics3 import save_tiny_idefics3

    path = tmp_path_factory.mktemp("tiny-idefics3")
    save_tiny_idefics3(str(path), default_tokenizer)
    return str(path)


@pytest.fixture(scope="session")
def tiny_idefics3_tiled_dir(tmp_path_factory, default_tokenizer):
    """The same weights (seeded) with a processor that tiles images, as SmolVLM's does."""
    from tests.multimodal.tiny_idefics3 import save_tiny_idefics3

    path = tmp_path_factory.mktemp("tiny-idefics3-tiled")
    save_tiny_idefics3(str(path), default_tokenizer, image_splitting=True)
    return str(path)


@pytest.fixture(scope="session")
def hf_tiny_idefics3(tiny_idefics3_dir):
    import torch
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    model = Idefics3ForConditionalGeneration.from_pretrained(tiny_idefics3_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(tiny_idefics3_dir)


def random_image(seed: int, width: int = 48, height: int = 40):
    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png_bytes(image) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
