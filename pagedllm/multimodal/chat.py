"""Image parts of chat messages: OpenAI's {"type": "image_url", "image_url": {"url": ...}}
(and vLLM's {"type": "image_pil", "image_pil": PIL.Image} offline) become {"type": "image"}
parts that chat templates place, and the images they name, in message order."""

from __future__ import annotations

from typing import Any

from pagedllm.multimodal.media import MediaConnector, MediaError

IMAGE_PART_TYPES = ("image_url", "image_pil", "image")


def has_image_parts(messages: list[dict[str, Any]]) -> bool:
    return any(
        isinstance(m.get("content"), list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
                                                  for p in m["content"])
        for m in messages
    )


def extract_images(messages: list[dict[str, Any]], media: MediaConnector) -> tuple[list[dict[str, Any]], list[Any]]:
    """(messages with each image part as {"type": "image"}, the images loaded, in order).
    MediaError (a ValueError) for an image that cannot be loaded."""
    out: list[dict[str, Any]] = []
    images: list[Any] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                images.append(media.load_image(url))
            elif kind == "image_pil":
                images.append(part.get("image_pil"))
            elif kind == "image":
                raise MediaError('an {"type": "image"} part carries no image; send image_url with a URL')
            else:
                parts.append(part)
                continue
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images
