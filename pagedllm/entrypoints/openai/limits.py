"""Request bodies checked before any route sees them (plain ASGI, so client disconnects still
reach the handlers): a size cap (413) and text that cannot be encoded (400).

Text: a JSON body must be UTF-8 (RFC 8259), and no string in it may hold a lone surrogate
(raw bytes such as ED B3 BF, or an escape such as ``"\\udcff"``): Python's JSON decoder would
hand such a string on, and it fails later where it is encoded (a tokenizer, a log line). The
check is one strict UTF-8 decode and a scan for ``\\ud8``-``\\udf`` escapes; only a body that
fails them is parsed here, to name the field.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai.serving_base import OpenAIError, bad_request

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.to_response().model_dump(), status_code=err.status)


def _first_bad_string(value: Any, path: str) -> str | None:
    """The path of the first key or string holding a lone surrogate, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            sub = f"{path}.{k}" if path else str(k)
            try:
                k.encode("utf-8")
            except UnicodeEncodeError:
                return (path + "." if path else "") + "<a key>"
            found = _first_bad_string(v, sub)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _first_bad_string(v, f"{path}.{i}" if path else str(i))
            if found is not None:
                return found
    return None


def check_body_text(body: bytes) -> OpenAIError | None:
    """A 400 naming the field if the body is not valid UTF-8 or a string holds a lone
    surrogate; None if the text is clean (or the body is not JSON: the route answers that)."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        pass
    else:
        if not _SURROGATE_ESCAPE.search(body):
            return None
    try:
        # bytes: the decoder keeps encoded surrogates (surrogatepass) so they can be found
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return bad_request("the request body is not valid UTF-8 JSON")
    field = _first_bad_string(data, "")
    if field is None:
        if not _has_raw_invalid(body):
            return None  # a valid surrogate pair, written as two escapes
        return bad_request("the request body is not valid UTF-8")
    return bad_request(f"{field}: invalid UTF-8 or a lone surrogate in the text", field)


def _has_raw_invalid(body: bytes) -> bool:
    try:
        body.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


class BodyCheckMiddleware:
    """Reads a request's body (up to max_body_bytes, else a 413) and checks its text before
    handing it on; requests without a body pass untouched."""

    def __init__(self, app: Any, max_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        too_large = _response(OpenAIError(
            f"the request body is larger than the server's limit of {self.max_body_bytes} bytes "
            "(--max-request-body-bytes)", 413, "RequestEntityTooLarge"))
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await too_large(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        err = check_body_text(body) if body else None
        if err is not None:
            await _response(err)(scope, receive, send)
            return
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls: the client's disconnect

        await self.app(scope, replay, send)


# ---- caps on list fields and spec sizes (issue 48) --------------------------------------
# vLLM has no flags for these; each is a constant here (docs/security.md lists them). A body
# within --max-request-body-bytes can still hold millions of small items, each costing work
# per request or per step (stop strings are matched every step, bad words masked every step).

LIST_FIELD_CAPS: dict[str, int] = {
    "prompt": 1024,  # prompts per completions request (each a sequence in the engine)
    "messages": 4096,
    "tools": 128,  # OpenAI's own limit
    "documents": 256,
    "stop": 64,
    "stop_token_ids": 1024,
    "bad_words": 256,
    "allowed_token_ids": 262144,  # above any vocabulary this engine serves
    "logit_bias": 1024,
    "guided_choice": 1024,
}
"""The most items each list (or map) field of a request may hold: more is a 400 naming the
field and the limit."""
MAX_STOP_STRING_CHARS = 1024
"""The longest stop string or bad word (each is matched against the output every step)."""
MAX_STRUCTURED_SPEC_CHARS = 256 * 1024
"""The largest JSON schema (serialized), regex, EBNF grammar or choice list a request may
give; xgrammar's compile time and memory grow with it."""

_SPEC_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                "guided_grammar")


def _too_many(field: str, n: int, cap: int) -> OpenAIError:
    return bad_request(f"{field} has {n} items; this server accepts at most {cap}", field)


def check_list_caps(req: Any) -> None:
    """A 400 for the first list field of ``req`` (a request model) over its cap, a stop string
    or bad word over MAX_STOP_STRING_CHARS, or a structured-outputs spec over
    MAX_STRUCTURED_SPEC_CHARS. Fields the model lacks are skipped."""
    for field, cap in LIST_FIELD_CAPS.items():
        value = getattr(req, field, None)
        if field == "prompt" and value and isinstance(value, list) and isinstance(value[0], int):
            continue  # one prompt of token ids: its length is checked against max_model_len
        if isinstance(value, (list, dict)) and len(value) > cap:
            raise _too_many(field, len(value), cap)
    for field in ("stop", "bad_words"):
        value = getattr(req, field, None)
        words = [value] if isinstance(value, str) else value or ()
        for i, word in enumerate(words):
            if isinstance(word, str) and len(word) > MAX_STOP_STRING_CHARS:
                raise bad_request(
                    f"{field}[{i}] has {len(word)} characters; this server accepts at most "
                    f"{MAX_STOP_STRING_CHARS}", field)
    for field in _SPEC_FIELDS:
        value = getattr(req, field, None)
        if value is None:
            continue
        size = len(value) if isinstance(value, str) else len(json.dumps(value, ensure_ascii=False))
        if size > MAX_STRUCTURED_SPEC_CHARS:
            raise bad_request(
                f"{field} is {size} characters long (as JSON); this server accepts structured-output "
                f"specs of at most {MAX_STRUCTURED_SPEC_CHARS}", field)
