"""Image loading (multimodal/media.py): data URLs, local files, http(s) with a size and time
limit; every refusal a MediaError naming the problem."""

from __future__ import annotations

import base64
import http.server
import threading
import time

import pytest

from pagedllm.multimodal.config import MultiModalConfig
from pagedllm.multimodal.media import MediaConnector, MediaError
from tests.multimodal.conftest import png_bytes, random_image

PNG = png_bytes(random_image(1, 20, 10))


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/slow.png":
            self.send_response(200)
            self.end_headers()
            for _ in range(20):  # trickles past the deadline, each read within httpx's timeout
                self.wfile.write(PNG[:16])
                self.wfile.flush()
                time.sleep(0.1)
            return
        body = PNG * 200 if self.path == "/big.png" else PNG if self.path == "/ok.png" else None
        self.send_response(200 if body else 404)
        self.end_headers()
        if body:
            self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def http_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_data_url_round_trip():
    image = MediaConnector(MultiModalConfig()).load_image("data:image/png;base64," + base64.b64encode(PNG).decode())
    assert image.size == (20, 10) and image.mode == "RGB"


def test_http_needs_the_domain_listed(http_url):
    with pytest.raises(MediaError, match="--allowed-media-domains 127.0.0.1"):
        MediaConnector(MultiModalConfig()).load_image(http_url + "/ok.png")
    allowed = MediaConnector(MultiModalConfig(allowed_media_domains=("127.0.0.1",)))
    assert allowed.load_image(http_url + "/ok.png").size == (20, 10)
    with pytest.raises(MediaError, match="HTTP 404"):
        allowed.load_image(http_url + "/missing.png")


def test_http_size_and_time_limits(http_url):
    small = MediaConnector(MultiModalConfig(allowed_media_domains=("127.0.0.1",), max_image_bytes=len(PNG) * 10))
    with pytest.raises(MediaError, match="more than the limit of"):
        small.load_image(http_url + "/big.png")
    quick = MediaConnector(MultiModalConfig(allowed_media_domains=("127.0.0.1",), media_fetch_timeout_s=0.5))
    start = time.monotonic()
    with pytest.raises(MediaError, match="took more than 0.5 s"):
        quick.load_image(http_url + "/slow.png")
    assert time.monotonic() - start < 1.5


def test_local_files_only_under_the_allowed_path(tmp_path):
    inside = tmp_path / "media"
    inside.mkdir()
    (inside / "a.png").write_bytes(PNG)
    (tmp_path / "b.png").write_bytes(PNG)
    with pytest.raises(MediaError, match="--allowed-local-media-path DIR"):
        MediaConnector(MultiModalConfig()).load_image(f"file://{inside}/a.png")
    connector = MediaConnector(MultiModalConfig(allowed_local_media_path=str(inside)))
    assert connector.load_image(f"file://{inside}/a.png").size == (20, 10)
    with pytest.raises(MediaError, match="outside"):
        connector.load_image(f"file://{inside}/../b.png")
    with pytest.raises(MediaError, match="cannot be read"):
        connector.load_image(f"file://{inside}/none.png")


def test_config_checks_the_limits():
    with pytest.raises(ValueError, match="supported: image"):
        MultiModalConfig(limit_per_prompt={"video": 1})
    with pytest.raises(ValueError, match="non-negative integer"):
        MultiModalConfig(limit_per_prompt={"image": -1})
