"""Reasoning parsers on fixed texts: the whole-output split, and the same text streamed through
the real default tokenizer one token per delta (markers split across tokens), one character per
delta and in one piece; the streamed parts concatenate to the whole-output split."""

from __future__ import annotations

import copy

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.reasoning import REASONING_PARSER_NAMES, get_reasoning_parser
from pagedllm.reasoning.base import ReasoningParser

THINKING_OFF_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3's enable_thinking=False
OPEN_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"  # R1 / Qwen3.5 templates
PLAIN_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
HARMONY_PROMPT = "<|start|>user<|message|>Hi<|end|><|start|>assistant"  # gpt-oss's generation prompt
# Granite 3.2's system message with thinking on: it quotes both phrases, which must not count.
GRANITE_PROMPT = (
    "<|start_of_role|>system<|end_of_role|>You are a helpful AI assistant. Write your thoughts after "
    "'Here is my thought process:' and write your response after 'Here is my response:' for each user query."
    "<|end_of_text|>\n<|start_of_role|>user<|end_of_role|>Hi<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>"
)
GRANITE_THINKING = {"thinking": True}

# (parser, prompt, chat_template_kwargs, output, expected reasoning, expected content)
CASES = [
    # The template opened the reasoning: the output holds only the end marker.
    ("deepseek_r1", OPEN_PROMPT, None, "Let me see: 2+2=4.</think>The answer is 4.", "Let me see: 2+2=4.", "The answer is 4."),
    # No marker in the prompt: R1 reasons all the same; a leading <think> is dropped.
    ("deepseek_r1", PLAIN_PROMPT, None, "<think>I think.</think>\n\nYes.", "I think.", "\n\nYes."),
    ("deepseek_r1", PLAIN_PROMPT, None, "Thinking without a start.</think>Done", "Thinking without a start.", "Done"),
    # max_tokens ran out inside the reasoning, even halfway through the end marker.
    ("deepseek_r1", OPEN_PROMPT, None, "I am still thinking about </thi", "I am still thinking about </thi", None),
    ("qwen3", PLAIN_PROMPT, None, "<think>\nstill going", "\nstill going", None),
    # Text that looks like the start of a marker, but is not one.
    ("qwen3", PLAIN_PROMPT, None, "a < b, <th and </b> </thin</think>c <think> d", "a < b, <th and </b> </thin", "c <think> d"),
    ("qwen3", PLAIN_PROMPT, None, "<think>\nok\n</think>\n\nDone", "\nok\n", "\n\nDone"),
    ("qwen3", OPEN_PROMPT, {"enable_thinking": True}, "Short.</think>", "Short.", None),
    ("qwen3", PLAIN_PROMPT, None, "</think>Only content", None, "Only content"),
    ("qwen3", PLAIN_PROMPT, None, "<thin", "<thin", None),
    # Thinking off: by the switch (a template that writes nothing), or by the prompt.
    ("qwen3", PLAIN_PROMPT, {"enable_thinking": False}, "Plain </think> answer", None, "Plain </think> answer"),
    ("qwen3", THINKING_OFF_PROMPT, None, "An answer.", None, "An answer."),
    ("deepseek_r1", THINKING_OFF_PROMPT, None, "An answer.", None, "An answer."),
    # The switch is Qwen3's: R1 ignores it.
    ("deepseek_r1", PLAIN_PROMPT, {"enable_thinking": False}, "R.</think>C", "R.", "C"),
    # gpt-oss's harmony: the analysis channel is reasoning, the final channel content (its
    # <|return|> when the detokenizer keeps it), a commentary preamble content; a tool call
    # stays harmony text for the `openai` tool parser; a header is never content.
    ("openai_gptoss", HARMONY_PROMPT, None,
     "<|channel|>analysis<|message|>User says hi. 1 < 2.<|end|><|start|>assistant<|channel|>final<|message|>Hello!<|return|>",
     "User says hi. 1 < 2.", "Hello!"),
    ("openai_gptoss", HARMONY_PROMPT, None, "<|channel|>final<|message|>Straight to it.", None, "Straight to it."),
    ("openai_gptoss", HARMONY_PROMPT, None, "<|channel|>analysis<|message|>Cut short <|en", "Cut short <|en", None),
    ("openai_gptoss", HARMONY_PROMPT, None, "<|channel|>analysis<|message|>A<|end|><|start|>assistant<|chan", "A", None),
    ("openai_gptoss", HARMONY_PROMPT, None,
     "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking."
     "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     '{"city": "Paris"}<|call|>',
     "Need weather.",
     'Checking.<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
     '{"city": "Paris"}<|call|>'),
    # Granite: thinking on by its template switch; either spelling of each phrase, mixed.
    ("granite", GRANITE_PROMPT, GRANITE_THINKING,
     "Here is my thought process:\nA < B.\n\nHere is my response:\n\nB is bigger.", "\nA < B.\n\n", "\n\nB is bigger."),
    ("granite", GRANITE_PROMPT, GRANITE_THINKING, "Here's my thought process: x Here's my response: y", " x ", " y"),
    ("granite", GRANITE_PROMPT, GRANITE_THINKING, "Here's my thought process:r Here is my response:c", "r ", "c"),
    # Near misses stay reasoning; the earliest complete phrase ends it; a later one is content.
    ("granite", GRANITE_PROMPT, GRANITE_THINKING,
     "Here is my thought process: Here is my answer: no. Here's my resp Here's my response:ok. Here is my response: z",
     " Here is my answer: no. Here's my resp ", "ok. Here is my response: z"),
    # Cut short inside the reasoning, even halfway through the response phrase.
    ("granite", GRANITE_PROMPT, GRANITE_THINKING, "Here is my thought process: still Here is my resp",
     " still Here is my resp", None),
    ("granite", GRANITE_PROMPT, GRANITE_THINKING, "Here is my thought process:", None, None),
    # Thinking on, but the output does not open with the phrase: all of it is content.
    ("granite", GRANITE_PROMPT, GRANITE_THINKING, "Sure! Here is my response: hi", None, "Sure! Here is my response: hi"),
    ("granite", GRANITE_PROMPT, GRANITE_THINKING, " Here is my thought process: a Here is my response: b",
     None, " Here is my thought process: a Here is my response: b"),
    ("granite", GRANITE_PROMPT, GRANITE_THINKING, "Here is my", None, "Here is my"),
    # Thinking off (the default; the prompt's quoted phrases do not turn it on): all content.
    ("granite", GRANITE_PROMPT, None, "Here is my thought process: a Here is my response: b",
     None, "Here is my thought process: a Here is my response: b"),
    ("granite", PLAIN_PROMPT, {"thinking": False}, "Hello.", None, "Hello."),
]


@pytest.fixture(scope="module")
def parsers(default_tokenizer):
    return {name: get_reasoning_parser(name)(default_tokenizer) for name in REASONING_PARSER_NAMES}


def token_deltas(tokenizer, text: str) -> list[str]:
    """The text as the server streams it: the decoded growth per token."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoded = [tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    assert decoded[-1] == text
    return [decoded[i + 1][len(decoded[i]):] for i in range(len(ids))]


def streamed(parser, in_reasoning: bool, deltas: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    stream = parser.stream(in_reasoning)
    parts = [stream.feed(d) for d in deltas]
    parts.append(stream.finish())
    return "".join(p.reasoning for p in parts), "".join(p.content for p in parts), parts


def test_registry_names_both_parsers():
    assert {"deepseek_r1", "granite", "openai_gptoss", "qwen3"} <= set(REASONING_PARSER_NAMES)
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("nope")
    with pytest.raises(ValueError, match="qwen3"):
        EngineArgs(reasoning_parser="nope").create_engine_config()


@pytest.mark.parametrize("name,prompt,kwargs,text,reasoning,content", CASES)
def test_split_whole_and_streamed(parsers, default_tokenizer, name, prompt, kwargs, text, reasoning, content):
    parser = parsers[name]
    in_reasoning = parser.starts_in_reasoning(prompt, kwargs)
    split = parser.split(text, in_reasoning)
    assert (split.reasoning, split.content) == (reasoning, content)
    by_token = token_deltas(default_tokenizer, text)
    for deltas in (by_token, list(text), [text]):
        got_reasoning, got_content, parts = streamed(parser, in_reasoning, deltas)
        assert (got_reasoning, got_content) == (reasoning or "", content or ""), deltas
        # Reasoning comes first: once a part holds content, no later part holds reasoning.
        first_content = next((i for i, p in enumerate(parts) if p.content), len(parts))
        assert not any(p.reasoning for p in parts[first_content + 1:])


def test_end_marker_split_across_tokens_is_held_back(parsers, default_tokenizer):
    """'</think>' is three tokens here ('</', 'think', '>'): none of them leaks into either part."""
    deltas = token_deltas(default_tokenizer, "Hmm.</think>{}")
    assert deltas[-4:-1] == ["</", "think", ">"]
    stream = parsers["qwen3"].stream(True)
    parts = [stream.feed(d) for d in deltas]
    assert [p.reasoning for p in parts] == ["H", "mm", ".", "", "", "", ""]
    assert [p.content for p in parts] == ["", "", "", "", "", "", "{}"]


def test_end_token_ids(parsers, default_tokenizer):
    """The default vocabulary spells '</think>' with several tokens (alone and after a space);
    a vocabulary with '</think>' as a token of its own gives that one id."""
    ids = parsers["qwen3"].end_token_ids
    assert sorted(default_tokenizer.decode(list(seq)) for seq in ids) == [" </think>", "</think>"]
    assert all(len(seq) > 1 for seq in ids)
    tokenizer = copy.deepcopy(default_tokenizer)
    tokenizer.add_tokens(["<think>", "</think>"])
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    assert get_reasoning_parser("deepseek_r1")(tokenizer).end_token_ids == ((think_end,),)


class _Prefixed(ReasoningParser):
    """Markers where one spelling is a prefix of another: the longer wins where both begin."""

    start_markers = ("<r>", "<r>>")
    end_markers = ("END", "END!")


@pytest.mark.parametrize("text,reasoning,content", [
    ("<r>>xEND!y", "x", "y"),
    ("<r>xENDy", "x", "y"),
    ("<r>xEND", "x", None),
    ("<r>xEN", "xEN", None),
    ("<r", "<r", None),
    ("xEND!END", "x", "END"),
])
def test_several_spellings_streamed_as_split(default_tokenizer, text, reasoning, content):
    parser = _Prefixed(default_tokenizer)
    assert (parser.start_marker, parser.end_marker) == ("<r>", "END")  # the first are canonical
    split = parser.split(text, True)
    assert (split.reasoning, split.content) == (reasoning, content)
    for deltas in (list(text), [text]):
        assert streamed(parser, True, deltas)[:2] == (reasoning or "", content or ""), deltas


def test_granite_end_token_ids(parsers, default_tokenizer):
    """Both spellings of the response phrase, alone and after a space, end the reasoning for
    the engine core (structured outputs start after it); a budget writes the first."""
    parser = parsers["granite"]
    spelled = sorted(default_tokenizer.decode(list(seq)) for seq in parser.end_token_ids)
    assert spelled == [" Here is my response:", " Here's my response:", "Here is my response:", "Here's my response:"]
    assert default_tokenizer.decode(list(parser.end_marker_ids)) == "Here is my response:"
