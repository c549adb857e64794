"""Request bodies checked before any route (issue 48 items 4 and 5): invalid UTF-8 and lone
surrogates in any string field are a 400 naming the field (not a 500 from the tokenizer), and
a body over --max-request-body-bytes is a 413."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.conftest import MODEL

BAD = b"\xed\xb3\xbf"  # a lone surrogate (U+DCFF) as raw bytes: not UTF-8


def _post(server, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(server.url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=60)


CASES = [
    ("/tokenize", b'{"model": "' + BAD + b'", "prompt": "hi"}', "model"),
    ("/tokenize", b'{"prompt": "a' + BAD + b'b"}', "prompt"),
    ("/tokenize", b'{"prompt": "a\\udcffb"}', "prompt"),  # the JSON escape of the same
    ("/v1/completions", b'{"model": "' + MODEL.encode() + b'", "prompt": ["ok", "x' + BAD + b'"], "max_tokens": 1}',
     "prompt.1"),
    ("/v1/chat/completions", b'{"model": "' + MODEL.encode() + b'", "max_tokens": 1, "messages": '
     b'[{"role": "user", "content": "' + BAD + b'"}]}', "messages.0.content"),
    ("/detokenize", b'{"tokens": [1], "model": "\\ud800"}', "model"),
]


@pytest.mark.parametrize("path,raw,field", CASES, ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_lone_surrogate_is_400_naming_field(server, path, raw, field):
    r = _post(server, path, raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err


def test_valid_surrogate_pair_escape_is_accepted(server):
    r = _post(server, "/tokenize", b'{"prompt": "\\ud83d\\ude00"}')  # an emoji as a JSON pair
    assert r.status_code == 200, r.text


def test_invalid_utf8_byte_is_400(server):
    r = _post(server, "/tokenize", b'{"prompt": "\xff"}')
    assert r.status_code == 400, r.text


def test_body_over_cap_is_413(server):
    huge = b'{"prompt": "' + b"a" * (33 * 1024 * 1024) + b'"}'
    r = _post(server, "/tokenize", huge)
    assert r.status_code == 413, r.text[:300]
    assert "max-request-body-bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(33):
            yield b"a" * (1024 * 1024)
        yield b'"}'

    r = httpx.post(server.url + "/tokenize", content=chunks(), headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413, r.text[:300]
    assert httpx.post(server.url + "/tokenize", json={"prompt": "hi"}).status_code == 200


def test_unknown_field_names_logged_escaped_and_truncated(server):
    """A client cannot forge log lines through an unknown field's name (issue 48 item 7)."""
    forged = "x\nFORGED-LOG-LINE " + "y" * 5000
    r = httpx.post(server.url + "/tokenize", json={"prompt": "hi", forged: 1}, timeout=60)
    assert r.status_code == 200, r.text
    log = server.log_path.read_text()
    assert "\nFORGED-LOG-LINE" not in log
    line = next(ln for ln in log.splitlines() if "FORGED-LOG-LINE" in ln)
    assert "x\\nFORGED-LOG-LINE" in line and len(line) < 400, line[:500]


def test_client_request_id_cannot_collide_with_another_requests_sequences(server):
    """Engine ids are the server's (issue 48 item 7): a request_id of "0_<id>" while <id> runs
    with n=2 (whose sequences are "0_<id>" and "1_<id>" in the engine), or the same id twice at
    once, leaves both requests whole."""
    import asyncio

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            first = client.post(server.url + "/v1/completions", json={
                "prompt": "Once upon a time", "max_tokens": 24, "n": 2, "ignore_eos": True, "request_id": "victim"})
            attacks = [client.post(server.url + "/v1/completions", json={
                "prompt": "Hello", "max_tokens": 4, "ignore_eos": True, "request_id": rid})
                for rid in ("0_victim", "victim")]
            return await asyncio.gather(first, *attacks)

    victim, *attacks = asyncio.run(run())
    assert victim.status_code == 200, victim.text
    body = victim.json()
    assert body["id"] == "victim"  # the client's id is still the response's
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    for r in attacks:
        assert r.status_code == 200, r.text
