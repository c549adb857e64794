"""Images from where requests name them: data: URLs, local files under
--allowed-local-media-path, http(s) hosts listed in --allowed-media-domains. Each is bounded
in bytes and in pixels (read from the header before anything is decoded), and every refusal
is a MediaError (a ValueError) whose message names the problem."""

from __future__ import annotations

import base64
import binascii
import io
import os
import time
import urllib.parse
from typing import Any

from pagedllm.multimodal.config import MultiModalConfig


class MediaError(ValueError):
    """An image that cannot be used; the message says why (a 400 at the server)."""


def decode_image(data: bytes, config: MultiModalConfig) -> Any:
    """An RGB PIL image from encoded bytes; MediaError for too many bytes or pixels, data
    that is not an image, or a truncated or corrupt file."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > config.max_image_bytes:
        raise MediaError(f"the image has {len(data)} bytes, more than the limit of {config.max_image_bytes}")
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except UnidentifiedImageError:
        raise MediaError("the image data is not an image format this server reads (PNG, JPEG, WebP, GIF, ...)") from None
    except Image.DecompressionBombError as e:
        raise MediaError(f"the image is too large: {e}") from None
    check_image_size(image.size, config)
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as e:  # PIL reports truncation and corruption so
        raise MediaError(f"the image data is truncated or corrupt ({e})") from None
    return image if image.mode == "RGB" else image.convert("RGB")


def check_image_size(size: tuple[int, int], config: MultiModalConfig) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise MediaError(f"the image has no pixels ({width}x{height})")
    if width * height > config.max_image_pixels:
        raise MediaError(
            f"the image is {width}x{height} = {width * height} pixels, more than the limit of "
            f"{config.max_image_pixels}")


class MediaConnector:
    """Loads the images that requests name by URL, within the engine's MultiModalConfig."""

    def __init__(self, config: MultiModalConfig) -> None:
        self.config = config
        root = config.allowed_local_media_path
        self.local_root = os.path.realpath(root) if root is not None else None

    def load_image(self, url: str) -> Any:
        """A PIL image from a data:, file: or http(s) URL; MediaError naming the problem."""
        if not isinstance(url, str) or not url:
            raise MediaError("image_url.url must be a non-empty string")
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return decode_image(self._data_url_bytes(url), self.config)
        if scheme == "file":
            return decode_image(self._file_bytes(url), self.config)
        if scheme in ("http", "https"):
            return decode_image(self._fetch(url), self.config)
        raise MediaError(f"image_url.url must be a data:, file: or http(s): URL, got scheme {scheme!r}")

    def _data_url_bytes(self, url: str) -> bytes:
        header, sep, payload = url[len("data:"):].partition(",")
        if not sep or not header.endswith(";base64"):
            raise MediaError("a data URL image must be data:<media type>;base64,<data>")
        media_type = header[: -len(";base64")]
        if media_type and not media_type.startswith("image/"):
            raise MediaError(f"a data URL image must have an image/* media type, got {media_type!r}")
        limit = self.config.max_image_bytes
        if len(payload) > (limit // 3 + 1) * 4:
            raise MediaError(f"the data URL holds more than the limit of {limit} image bytes")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise MediaError("the data URL's base64 payload is not valid base64") from None

    def _file_bytes(self, url: str) -> bytes:
        if self.local_root is None:
            raise MediaError("file: image URLs are off; start the server with --allowed-local-media-path DIR")
        path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlparse(url).path))
        if os.path.commonpath([path, self.local_root]) != self.local_root:
            raise MediaError(f"the file {path!r} is outside --allowed-local-media-path {self.local_root!r}")
        try:
            size = os.path.getsize(path)
            if size > self.config.max_image_bytes:
                raise MediaError(f"the image file has {size} bytes, more than the limit of {self.config.max_image_bytes}")
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise MediaError(f"the image file cannot be read: {e.strerror}") from None

    def _fetch(self, url: str) -> bytes:
        host = (urllib.parse.urlparse(url).hostname or "").lower()
        if host not in self.config.allowed_media_domains:
            raise MediaError(
                f"fetching images from {host!r} is off; start the server with --allowed-media-domains {host}")
        import httpx

        limit, chunks, total = self.config.max_image_bytes, [], 0
        deadline = time.monotonic() + self.config.media_fetch_timeout_s  # httpx's timeout is per read
        try:
            with httpx.stream("GET", url, timeout=self.config.media_fetch_timeout_s, follow_redirects=False) as r:
                if r.status_code != 200:
                    raise MediaError(f"fetching the image returned HTTP {r.status_code}")
                for chunk in r.iter_bytes():
                    total += len(chunk)
                    if total > limit:
                        raise MediaError(f"the image at {url!r} is more than the limit of {limit} bytes")
                    chunks.append(chunk)
                    if time.monotonic() > deadline:
                        raise MediaError(f"fetching the image took more than {self.config.media_fetch_timeout_s} s")
        except httpx.HTTPError as e:
            raise MediaError(f"fetching the image failed: {type(e).__name__}: {e}") from None
        return b"".join(chunks)
