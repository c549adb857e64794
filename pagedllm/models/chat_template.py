"""Chat templates rendered as transformers' `apply_chat_template(tokenize=False)` renders them,
without importing transformers (the snapshot tokenizer of a GGUF model, tokenizer_snapshot.py).

What a template sees, and how, follows transformers 5's renderer: a sandboxed Jinja
environment with `trim_blocks` and `lstrip_blocks`, loop controls and the `{% generation %}`
block; a `tojson` filter that writes non-ASCII as is; `raise_exception`, `strftime_now`,
`dict` and `namespace` (no underscore names) as globals; the tokenizer's named special tokens
(`bos_token`, ...) under the caller's variables; messages with None-valued keys dropped and
the reasoning copied under `thinking` and `reasoning_content`; a continued final message cut
where its content ends. Only plain JSON data goes through here (`is_plain`): anything else
(callable tools, pydantic messages, the assistant mask) is the caller's to hand to
transformers itself. tests/models/test_tokenizer_snapshot.py compares the two.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
# Appended to the continued text so its end can be found in the rendered chat.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_PLAIN_SCALARS = (str, int, float, bool, type(None))


def is_plain(value: Any) -> bool:
    """Whether `value` is JSON data built of exact dicts, lists, tuples and scalars (no
    subclasses, no objects), the inputs render() takes."""
    kind = type(value)
    if kind in _PLAIN_SCALARS:
        return True
    if kind is dict:
        return all(type(k) in _PLAIN_SCALARS and is_plain(v) for k, v in value.items())
    if kind in (list, tuple):
        return all(is_plain(v) for v in value)
    return False


def _copy(value: Any) -> Any:
    """A deep copy of plain data, so a render never edits the caller's messages."""
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copy(v) for v in value)
    return value


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: renders its body (the span it marks is
        only read for an assistant-token mask, which transformers computes)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        """`dict(...)` and `dict.fromkeys(...)` for templates, without the type's attributes."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class Namespace(jinja2.utils.Namespace):
        """Jinja's namespace, refusing underscore names (no way to CPython internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's signature)
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                Namespace.check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace.check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set the namespace attribute {name!r}")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=TemplateDict(), namespace=Namespace)
    return env.from_string(template)


def _with_reasoning_aliases(chat: list[Any]) -> list[Any]:
    """Each message's reasoning (under any of its names) also as `thinking` (first) and
    `reasoning_content` (last), the names templates read."""
    out = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tag_final_message(chat: list[Any], field: str, template: str) -> str:
    """Append the continue tag to the final message's `field` (its last text block for a
    list of blocks); returns the text continued. ValueError where there is none."""
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
    fields = [field]
    if field in _REASONING_KEYS:  # copied under several names: tag every copy
        fields = [k for k in _REASONING_KEYS if chat[-1].get(k) == final]
    if not any(k in template for k in fields):
        raise ValueError(f'continue_final_message is set to "{field}" but this is not an accepted field in the chat_template')
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if "text" in block:
                text = block["text"]
                block["text"] = text + _CONTINUE_TAG
                return text
        raise ValueError("continue_final_message is set but we could not find any text to continue in the final message!")
    for k in fields:
        chat[-1][k] = chat[-1][k] + _CONTINUE_TAG
    return final


def _cut_after_final_message(rendered: str, final: str) -> str:
    """The rendered chat up to where the continued message's text ends."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat after applying the "
            f"chat template (the template removes part of it?). Final message: {final.strip()}"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space


def render(
    template: str, conversations: list[list[dict]], special_tokens: dict[str, str], *,
    tools: list[dict] | None = None, documents: list[dict] | None = None, add_generation_prompt: bool = False,
    continue_final_message: bool | str = False, variables: dict[str, Any] | None = None,
) -> list[str]:
    """Each conversation rendered with `template`; the inputs are plain data (is_plain)."""
    compiled = _compiled(template)
    context = {**special_tokens, **_copy(variables or {})}  # the caller's variables win
    tools, documents = _copy(tools), _copy(documents)
    rendered = []
    for conversation in conversations:
        chat = [{k: v for k, v in _copy(m).items() if v is not None} for m in conversation]
        chat = _with_reasoning_aliases(chat)
        final = None
        if continue_final_message:
            if not chat:
                raise ValueError("continue_final_message is set but the conversation is empty!")
            field = continue_final_message if isinstance(continue_final_message, str) else "content"
            final = _tag_final_message(chat, field, template)
        text = compiled.render(messages=chat, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **context)
        rendered.append(text if final is None else _cut_after_final_message(text, final))
    return rendered
