"""Images through a real server: the official openai client sends a base64 image and gets
HF's greedy answer; every bad image is a 400 in OpenAI's error shape naming the problem, and
the server keeps serving with no KV block left behind."""

from __future__ import annotations

import base64
import struct
import time
import zlib

import httpx
import openai
import pytest

from tests.entrypoints.utils import RemoteServer, metric_value
from tests.multimodal.conftest import png_bytes, random_image
from tests.multimodal.test_idefics3 import MAX_TOKENS, hf_greedy_mm
from tests.utils import assert_greedy_match

pytestmark = pytest.mark.slow  # a server start (~20 s)

TEMPLATE_TEXT = "<|im_start|>user\n<image>What is in the picture?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def vlm_server(tiny_idefics3_dir, media_dir):
    srv = RemoteServer([
        "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", "16MiB", "--block-size", "8",
        "--limit-mm-per-prompt", '{"image": 2}', "--allowed-local-media-path", str(media_dir),
    ], model=tiny_idefics3_dir)
    yield srv
    srv.stop()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_message(url: str, text: str = "What is in the picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def test_openai_client_base64_image_matches_hf(vlm_server, tiny_idefics3_dir, hf_tiny_idefics3):
    image = random_image(7, 56, 44)
    client = openai.OpenAI(base_url=vlm_server.base_url, api_key="none")
    r = client.chat.completions.create(
        model=tiny_idefics3_dir, messages=image_message(data_url(png_bytes(image))), max_tokens=MAX_TOKENS,
        temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    ref, gaps = hf_greedy_mm(hf_tiny_idefics3, {"prompt": TEMPLATE_TEXT, "multi_modal_data": {"image": [image]}})
    assert_greedy_match(r.choices[0].token_ids, ref, gaps, "server")
    assert r.usage.prompt_tokens == len(r.prompt_token_ids)
    stream = client.chat.completions.create(
        model=tiny_idefics3_dir, messages=image_message(data_url(png_bytes(image))), max_tokens=MAX_TOKENS,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == r.choices[0].message.content


def test_concurrent_image_requests(vlm_server, tiny_idefics3_dir):
    """Eight image requests at once (preprocessed on worker threads) answer as one at a time."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(seed: int) -> list[int]:
        body = {"model": tiny_idefics3_dir, "messages": image_message(data_url(png_bytes(random_image(seed)))),
                "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        r = httpx.post(vlm_server.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    seeds = list(range(30, 38))
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, seeds))
    assert together == [ask(s) for s in seeds]
    assert len({tuple(t) for t in together}) > 1  # the images matter


def test_local_file_under_the_allowed_path(vlm_server, tiny_idefics3_dir, media_dir):
    image = random_image(8)
    path = media_dir / "picture.png"
    path.write_bytes(png_bytes(image))
    body = {"model": tiny_idefics3_dir, "messages": image_message(f"file://{path}"), "max_tokens": 2}
    r = httpx.post(vlm_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height (its pixel data is one tiny row): a
    decompression bomb's header, refused before any decoding."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 4)) + chunk(b"IEND", b"")


def _bad_cases(tmp_outside: str) -> list[tuple[str, object, str]]:
    good = png_bytes(random_image(9))
    return [
        ("truncated", image_message(data_url(good[: len(good) // 2])), "truncated or corrupt"),
        ("not an image", image_message(data_url(b"hello, not pixels")), "not an image format"),
        ("no base64 marker", image_message("data:image/png," + base64.b64encode(good).decode()),
         "data:<media type>;base64"),
        ("bad base64", image_message("data:image/png;base64,@@@notbase64@@@"), "not valid base64"),
        ("wrong media type", image_message(data_url(good, "text/plain")), "image/* media type"),
        ("huge dimensions", image_message(data_url(_png_header_only(10_000, 10_000))), "more than the limit"),
        ("decompression bomb", image_message(data_url(_png_header_only(100_000, 100_000))), "too large"),
        ("file outside the allowed path", image_message(f"file://{tmp_outside}"), "outside --allowed-local-media-path"),
        ("http not allowed", image_message("http://example.com/cat.png"), "--allowed-media-domains example.com"),
        ("other scheme", image_message("ftp://example.com/cat.png"), "data:, file: or http(s)"),
        ("too many images", [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(good)}} for _ in range(3)]}],
         "--limit-mm-per-prompt"),
    ]


def test_bad_images_are_400s_and_the_server_keeps_serving(vlm_server, tiny_idefics3_dir, tmp_path):
    outside = tmp_path / "secret.png"
    outside.write_bytes(png_bytes(random_image(10)))
    for label, messages, contains in _bad_cases(str(outside)):
        body = {"model": tiny_idefics3_dir, "messages": messages, "max_tokens": 2}
        r = httpx.post(vlm_server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, (label, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == "messages", (label, err)
        assert contains in err["message"], (label, err["message"])
    ok = {"model": tiny_idefics3_dir, "messages": image_message(data_url(png_bytes(random_image(11)))),
          "max_tokens": 2}
    assert httpx.post(vlm_server.url + "/v1/chat/completions", json=ok, timeout=60).status_code == 200
    deadline = time.monotonic() + 30
    while True:  # every block back in the pool once nothing runs
        usage = metric_value(httpx.get(vlm_server.url + "/metrics").text, "pagedllm:kv_cache_usage_perc")
        if usage == 0.0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert usage == 0.0

