"""Tool parsers on fixed model texts, streamed through the default model's real tokenizer one
token per delta (as the server's detokenizer produces them): the streamed deltas must join
to the non-streamed answer byte for byte, and both must be the expected calls."""

from __future__ import annotations

import json

import pytest

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser, tool_parser_names
from pagedllm.entrypoints.openai.tool_parsers.handler import (
    ToolCallConfig,
    ToolCallHandler,
    ToolChoiceError,
    finish_reason_with_calls,
)
from pagedllm.entrypoints.openai.tool_parsers.abstract import ParsedText, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.stream import ToolStreamState

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}
# For qwen3_coder, whose values are text converted by the schema's types.
CONFIGURE = {"name": "configure", "parameters": {"type": "object", "properties": {
    "count": {"type": "integer"}, "ratio": {"type": "number"}, "on": {"type": "boolean"}, "tags": {"type": "array"},
    "opts": {"type": "object"}, "label": {"type": "string"}, "note": {"type": ["string", "null"]},
    "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "whole": {"type": "number"}}}}
FUNCTIONS = [WEATHER, ADD, CONFIGURE]
HERMES = ToolCallConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")

# Arguments that test the settled-prefix rule: nesting, closers inside strings, escapes,
# non-ASCII, numbers that grow digit by digit, literals.
TRICKY = {"q": "a}]b \"quoted\" Zürich", "n": [1, 22.5, {"deep": [None, True]}], "big": 12345, "e": {}}
TRICKY_JSON = json.dumps(TRICKY, ensure_ascii=False)
PARIS = {"city": "Paris", "unit": "celsius"}
PARIS_JSON = json.dumps(PARIS)

CASES = {
    "hermes text then a call": (
        "hermes", f'Let me look that up.\n<tool_call>\n{{"name": "get_weather", "arguments": {PARIS_JSON}}}\n</tool_call>',
        "Let me look that up.\n", [("get_weather", PARIS)]),
    "hermes two calls, text after": (
        "hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
                  f'<tool_call>\n{{"name": "get_weather", "arguments": {TRICKY_JSON}}}\n</tool_call>\nDone.',
        "\n\nDone.", [("add", {"a": 2, "b": 3}), ("get_weather", TRICKY)]),
    "hermes malformed call is content": (
        "hermes", '<tool_call>\n{"name": get_weather, "arguments": {}}\n</tool_call> sorry',
        '<tool_call>\n{"name": get_weather, "arguments": {}}\n</tool_call> sorry', []),
    "hermes marker look-alikes are content": (
        "hermes", "1 < 2, and <tool_calls> or <tool_call are words here", 
        "1 < 2, and <tool_calls> or <tool_call are words here", []),
    "hermes arguments as a JSON string": (
        "hermes", '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>',
        "", [("add", {"a": 1, "b": 2})]),
    "llama3_json two calls": (
        "llama3_json", f'{{"name": "get_weather", "parameters": {PARIS_JSON}}}; {{"name": "add", "parameters": {TRICKY_JSON}}}',
        "", [("get_weather", PARIS), ("add", TRICKY)]),
    "llama3_json python tag": (
        "llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}', "", [("add", {"a": 2, "b": 3})]),
    "llama3_json plain text": ("llama3_json", "The answer is {x}.", "The answer is {x}.", []),
    "llama3_json malformed is content": (
        "llama3_json", '{"name": add, "parameters": {"a": 2}}', '{"name": add, "parameters": {"a": 2}}', []),
    "mistral text then two calls": (
        "mistral", f'Sure.[TOOL_CALLS][{{"name": "get_weather", "arguments": {PARIS_JSON}}}, '
                   f'{{"name": "add", "arguments": {TRICKY_JSON}}}]',
        "Sure.", [("get_weather", PARIS), ("add", TRICKY)]),
    "mistral plain text": ("mistral", "No [TOOL] calls [here].", "No [TOOL] calls [here].", []),
    "pythonic two calls": (
        "pythonic", "[get_weather(city=\"Paris\", unit='celsius'), add(a=2, b=[1, 2], c={'k': 'v, w)]'})]",
        "", [("get_weather", PARIS), ("add", {"a": 2, "b": [1, 2], "c": {"k": "v, w)]"}})]),
    "pythonic plain text": ("pythonic", "Sure, here you go.", "Sure, here you go.", []),
    # gpt-oss's harmony (as the openai_gptoss reasoning parser leaves the content, or raw):
    # commentary messages to functions.NAME are calls, either header order; the final channel
    # and preambles are content, analysis is not; a body that is not JSON is kept as written.
    "openai preamble then a call": (
        "openai", "Checking.<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                  f"<|message|>{PARIS_JSON}<|call|>", "Checking.", [("get_weather", PARIS)]),
    "openai raw turn, two calls": (
        "openai", "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant to=functions.add<|channel|>commentary json"
                  '<|message|>{"a": 2, "b": 3}<|call|><|start|>assistant<|channel|>commentary to=functions.get_weather'
                  f"<|message|>{TRICKY_JSON}", "", [("add", {"a": 2, "b": 3}), ("get_weather", TRICKY)]),
    "openai final answer only": (
        "openai", "<|channel|>final<|message|>It is 20 C in <|Paris|>.<|return|>", "It is 20 C in <|Paris|>.", []),
    "openai plain text": ("openai", "No harmony here: a <| b.", "No harmony here: a <| b.", []),
    "pythonic malformed is content": ("pythonic", "[get_weather(city=Paris)]", "[get_weather(city=Paris)]", []),
    "qwen3_coder text then two calls, typed values": (
        "qwen3_coder", "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                       "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=configure>\n"
                       "<parameter=count>\n42\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
                       "<parameter=on>\nTrue\n</parameter>\n<parameter=tags>\n[\"a\", \"b}\"]\n</parameter>\n"
                       "<parameter=opts>\n{'k': 1}\n</parameter>\n<parameter=label>\n007\n</parameter>\n"
                       "<parameter=note>\nnull\n</parameter>\n<parameter=maybe>\nNone\n</parameter>\n"
                       "<parameter=whole>\n3.0\n</parameter>\n<parameter=extra>\nline1\nline2 <b> \"Zürich\"\n</parameter>\n"
                       "</function>\n</tool_call>\nDone.",
        "I'll check.\n\n\nDone.",
        [("get_weather", PARIS), ("configure", {"count": 42, "ratio": 0.5, "on": True, "tags": ["a", "b}"], "opts": {"k": 1},
                                                "label": "007", "note": None, "maybe": None, "whole": 3, "extra": "line1\nline2 <b> \"Zürich\""})]),
    "qwen3_coder closing tags left out": (
        "qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\n2\n<parameter=b>\n3\n</function>\n</tool_call>",
        "", [("add", {"a": 2, "b": 3})]),
    "qwen3_coder value that does not convert stays text": (
        "qwen3_coder", "<tool_call><function=add><parameter=a>two</parameter></function></tool_call>",
        "", [("add", {"a": "two"})]),
    "qwen3_coder malformed call is content": (
        "qwen3_coder", "<tool_call>\nnot a function\n</tool_call> sorry", "<tool_call>\nnot a function\n</tool_call> sorry", []),
    "qwen3_coder plain text": ("qwen3_coder", "1 < 2 and <tool_calls> are words", "1 < 2 and <tool_calls> are words", []),
    "deepseek_v3 text then two calls": (
        "deepseek_v3", "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                       f"```json\n{PARIS_JSON}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n"
                       f"```json\n{TRICKY_JSON}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "Let me check.", [("get_weather", PARIS), ("add", TRICKY)]),
    "deepseek_v3 plain text": ("deepseek_v3", "Use ```json fences``` <｜here｜>.", "Use ```json fences``` <｜here｜>.", []),
    "deepseek_v3 malformed call is content": (
        "deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>no separator<｜tool▁call▁end｜><｜tool▁calls▁end｜> ok",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>no separator<｜tool▁call▁end｜><｜tool▁calls▁end｜> ok", []),
    "granite two calls": (
        "granite", f'<|tool_call|>[{{"name": "get_weather", "arguments": {PARIS_JSON}}}, '
                   f'{{"name": "add", "arguments": {TRICKY_JSON}}}]',
        "", [("get_weather", PARIS), ("add", TRICKY)]),
    "granite 3.1 marker": (
        "granite", '<tool_call>[{"name": "add", "arguments": {"a": 2, "b": 3}}]', "", [("add", {"a": 2, "b": 3})]),
    "granite plain text": ("granite", "<tool> is not a marker [1]", "<tool> is not a marker [1]", []),
    "phi4_mini_json text then a call": (
        "phi4_mini_json", f'Sure. functools[{{"name": "get_weather", "arguments": {PARIS_JSON}}}, '
                          f'{{"name": "add", "arguments": {TRICKY_JSON}}}]',
        "Sure. ", [("get_weather", PARIS), ("add", TRICKY)]),
    "phi4_mini_json plain text": ("phi4_mini_json", "Use functools.partial here.", "Use functools.partial here.", []),
}


def token_texts(tokenizer, text: str) -> list[str]:
    """The output so far after each token, from the server's incremental detokenizer."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    so_far, texts = "", []
    for token_id in ids:
        so_far += detok.update([token_id])
        texts.append(so_far)
    assert so_far == text  # the tokenizer round-trips the fixed text
    return texts


def run_stream(state: ToolStreamState, texts: list[str]) -> tuple[str, list[tuple[str, str, str]]]:
    """Feed one token's text at a time; (content, [(id, name, arguments)]), checking that id
    and name come once, in a call's first delta, and that indices count up from 0."""
    content, calls = "", []
    for i, text in enumerate(texts):
        delta = state.update(text, final=i == len(texts) - 1)
        content += delta.content
        for d in delta.tool_calls:
            if d.index == len(calls):
                assert d.id and d.id.startswith("call_") and d.name, d
                calls.append([d.id, d.name, d.arguments])
            else:
                assert d.index < len(calls) and d.id is None and d.name is None, d
                calls[d.index][2] += d.arguments
    return content, [tuple(c) for c in calls]


@pytest.mark.parametrize("case", sorted(CASES))
def test_streamed_equals_full_parse(default_tokenizer, case):
    name, text, content, expected = CASES[case]
    full = get_tool_parser(name, FUNCTIONS).parse(text, final=True)
    assert full.content == content
    assert [(c.name, json.loads(c.arguments)) for c in full.calls] == expected
    streamed_content, streamed_calls = run_stream(ToolStreamState(get_tool_parser(name, FUNCTIONS)),
                                                  token_texts(default_tokenizer, text))
    assert streamed_content == full.content
    assert [(n, a) for _, n, a in streamed_calls] == [(c.name, c.arguments) for c in full.calls]


def test_json_broken_after_the_name_has_streamed(default_tokenizer):
    """The limit of streaming: a call whose name has gone out stays a call (with what had
    streamed of its arguments), and the text then follows as content, so nothing is lost;
    the non-streamed answer is the text as content alone."""
    text = '{"name": "add", "parameters": {"a": 2,, "b": 3}}'
    full = get_tool_parser("llama3_json").parse(text, final=True)
    assert (full.content, full.calls) == (text, [])
    content, calls = run_stream(ToolStreamState(get_tool_parser("llama3_json")), token_texts(default_tokenizer, text))
    assert content == text and [(n, a) for _, n, a in calls] == [("add", "{")]  # 2 was never settled


def test_deepseek_v3_malformed_arguments_are_content():
    """Not streamed: a call whose JSON is broken leaves the calls' section as text (streamed,
    its name has gone out first: the limit shown above)."""
    text = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{a: 1}\n```"
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    full = get_tool_parser("deepseek_v3").parse(text, final=True)
    assert (full.content, full.calls) == (text, [])


def test_markers_split_across_tokens(default_tokenizer):
    # What makes holding back partial markers necessary with this tokenizer.
    for marker in ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>"):
        assert len(default_tokenizer.encode(marker, add_special_tokens=False)) > 1


def test_arguments_stream_in_several_fragments(default_tokenizer):
    text = CASES["hermes two calls, text after"][1]
    state = ToolStreamState(get_tool_parser("hermes"))
    texts = token_texts(default_tokenizer, text)
    fragments = [d for i, t in enumerate(texts) for d in state.update(t, final=i == len(texts) - 1).tool_calls
                 if d.index == 1]
    assert len(fragments) > 5  # the tricky arguments arrive piece by piece, not at the end


def test_n_choices_stream_independently(default_tokenizer):
    """n > 1: one state per choice from one handler, fed interleaved."""
    handler = ToolCallHandler.for_request([WEATHER, ADD], "auto", None, HERMES)
    texts = [token_texts(default_tokenizer, CASES[c][1]) for c in ("hermes text then a call", "hermes two calls, text after")]
    states = [handler.stream(), handler.stream()]
    outs = [["", {}], ["", {}]]
    for step in range(max(map(len, texts))):
        for i, (state, choice_texts) in enumerate(zip(states, texts)):
            if step < len(choice_texts):
                delta = state.update(choice_texts[step], final=step == len(choice_texts) - 1)
                outs[i][0] += delta.content
                for d in delta.tool_calls:
                    outs[i][1][d.index] = outs[i][1].get(d.index, "") + d.arguments
    for (content, args), choice_texts in zip(outs, texts):
        result = handler.result(choice_texts[-1])
        assert [a for _, a in sorted(args.items())] == [c.arguments for _, c in result.tool_calls]
        assert content == handler.parser.parse(choice_texts[-1], final=True).content
    assert states[0].ids[0] != states[1].ids[0]


def test_auto_without_calls_is_plain_content(default_tokenizer):
    handler = ToolCallHandler.for_request([WEATHER], None, None, HERMES)  # tools given: default auto
    text = "It is sunny in Paris today."
    result = handler.result(text)
    assert result.content == text and result.tool_calls == []
    content, calls = run_stream(handler.stream(), token_texts(default_tokenizer, text))
    assert content == text and calls == []


def test_content_is_null_beside_calls_only():
    handler = ToolCallHandler.for_request([ADD], "auto", None, HERMES)
    only_calls = handler.result('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n')
    assert only_calls.content is None and len(only_calls.tool_calls) == 1
    assert finish_reason_with_calls("stop", True) == "tool_calls"
    assert finish_reason_with_calls("length", True) == "length"
    assert finish_reason_with_calls("stop", False) == "stop"


@pytest.mark.parametrize("choice,text,expected", [
    ({"name": "add"}, '{"a":2,"b":30}', [("add", {"a": 2, "b": 30})]),
    ("required", '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"add","parameters":{"a":1,"b":2}}]',
     [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]),
])
def test_forced_output_streams_as_calls(default_tokenizer, choice, text, expected):
    """The grammar-constrained output (compact JSON), read back whatever the parser flag."""
    handler = ToolCallHandler.for_request([WEATHER, ADD], choice, None, ToolCallConfig())
    assert handler is not None and handler.structured_outputs is not None
    result = handler.result(text)
    assert result.content is None
    assert [(c.name, json.loads(c.arguments)) for _, c in result.tool_calls] == expected
    content, calls = run_stream(handler.stream(), token_texts(default_tokenizer, text))
    assert content == ""
    assert [(n, a) for _, n, a in calls] == [(c.name, c.arguments) for _, c in result.tool_calls]


def test_required_schema_counts_calls():
    one = ToolCallHandler.for_request([WEATHER, ADD], "required", False, ToolCallConfig()).structured_outputs.json
    many = ToolCallHandler.for_request([WEATHER, ADD], "required", None, ToolCallConfig()).structured_outputs.json
    assert (one["minItems"], one["maxItems"]) == (1, 1)
    assert many["minItems"] == 1 and "maxItems" not in many
    assert [v["properties"]["name"]["enum"] for v in many["items"]["anyOf"]] == [["get_weather"], ["add"]]


@pytest.mark.parametrize("functions,choice,config,param,contains", [
    ([WEATHER], "auto", ToolCallConfig(), "tool_choice", "--enable-auto-tool-choice"),
    ([WEATHER], None, ToolCallConfig(), "tool_choice", "--enable-auto-tool-choice"),
    (None, "required", ToolCallConfig(), "tool_choice", "tools"),
    ([WEATHER], {"name": "add"}, ToolCallConfig(), "tool_choice", "'add'"),
])
def test_refused_choices(functions, choice, config, param, contains):
    with pytest.raises(ToolChoiceError) as e:
        ToolCallHandler.for_request(functions, choice, None, config)
    assert e.value.param == param and contains in str(e.value)


def test_plain_text_choices():
    assert ToolCallHandler.for_request([WEATHER], "none", None, ToolCallConfig()) is None
    assert ToolCallHandler.for_request(None, None, None, HERMES) is None


def test_registry_and_config():
    assert tool_parser_names() == ["deepseek_v3", "granite", "hermes", "llama3_json", "mistral", "openai",
                                   "phi4_mini_json", "pythonic", "qwen3_coder"]
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ToolCallConfig(enable_auto_tool_choice=True)


class CountingParser(ToolParser):
    """A real parser that counts the characters it is given (the streaming layer's work)."""

    def __init__(self, inner: ToolParser) -> None:
        super().__init__()
        self.inner, self.fed = inner, 0

    def parse(self, text: str, final: bool) -> ParsedText:
        self.fed += len(text)
        return self.inner.parse(text, final)


LONG_PROSE = "The weather in Paris is mild, with a light breeze [1] from the west; {no calls here}. " * 40


@pytest.mark.parametrize("name,text", [
    ("hermes", LONG_PROSE + CASES["hermes two calls, text after"][1] * 15),
    ("qwen3_coder", (LONG_PROSE + CASES["qwen3_coder text then two calls, typed values"][1]) * 4),
    ("deepseek_v3", LONG_PROSE * 3 + CASES["deepseek_v3 text then two calls"][1]),
    ("mistral", LONG_PROSE * 3),
    ("phi4_mini_json", LONG_PROSE * 3),
    ("llama3_json", LONG_PROSE * 3),
    ("pythonic", LONG_PROSE * 3),
    ("granite", LONG_PROSE * 3),
])
def test_stream_parse_work_is_linear(default_tokenizer, name, text):
    """Streaming one token at a time feeds the parser the text since its last settled point,
    not the whole output again: the characters parsed stay within a small multiple of the
    output's length (re-parsing everything costs about tokens/2 times the length), and the
    answer is the same as the whole text's parse."""
    texts = token_texts(default_tokenizer, text)
    counting = CountingParser(get_tool_parser(name, FUNCTIONS))
    content, calls = run_stream(ToolStreamState(counting), texts)
    assert counting.fed < 40 * len(text), (counting.fed, len(text), len(texts))
    full = get_tool_parser(name, FUNCTIONS).parse(text, final=True)
    assert content == full.content
    assert [(n, a) for _, n, a in calls] == [(c.name, c.arguments) for c in full.calls]
