"""Every request field the protocol accepts, sent to a real server through the official openai
client: each changes what it should, or is refused with a 400 naming it; none is dropped. (A
field the protocol does not know is ignored with a warning: test_errors.py.)

FIELD_CHECKS has one check per field of CompletionRequest, ChatCompletionRequest and
StreamOptions; test_every_field_has_a_check keeps it complete when a field is added.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable

import httpx
import openai
import pytest

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from tests.entrypoints.conftest import MODEL
from tests.entrypoints.test_errors import assert_error
from tests.entrypoints.test_metrics_disconnect import metrics
from tests.entrypoints.utils import metric_value

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
COUNTING = "1, 2, 3, 4,"
YES = [{"role": "user", "content": "Say only the word yes."}]
GREEDY = {"temperature": 0, "max_tokens": 6}
IM_START = 1  # SmolLM2's <|im_start|>: an added special token, not an EOS


class Ctx:
    """What a check gets: the server, the openai client, the tokenizer, cached greedy answers."""

    def __init__(self, server, client: openai.OpenAI, tokenizer) -> None:
        self.server, self.client, self.tokenizer = server, client, tokenizer
        self._cache: dict[str, object] = {}

    def complete(self, prompt: str | list = PROMPT, **kwargs):
        extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in _OPENAI_COMPLETION_ARGS}
        args = {**GREEDY, **kwargs}
        return self.client.completions.create(model=MODEL, prompt=prompt, extra_body=extra or None, **args)

    def chat(self, messages: list[dict] = YES, **kwargs):
        extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in _OPENAI_CHAT_ARGS}
        args = {**GREEDY, **kwargs}
        return self.client.chat.completions.create(model=MODEL, messages=messages, extra_body=extra or None, **args)

    def greedy(self, prompt: str = PROMPT):
        """The plain greedy completion of a prompt (computed once)."""
        key = f"complete:{prompt}"
        if key not in self._cache:
            self._cache[key] = self.complete(prompt)
        return self._cache[key]

    def greedy_chat(self):
        if "chat" not in self._cache:
            self._cache["chat"] = self.chat()
        return self._cache["chat"]

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.server.url + path, json={"model": MODEL, **body}, timeout=120)

    def refused(self, path: str, body: dict, param: str, contains: str = "") -> None:
        assert_error(self.post(path, body), 400, param, contains)


_OPENAI_COMPLETION_ARGS = {"max_tokens", "n", "stop", "temperature", "top_p", "seed", "presence_penalty",
                           "frequency_penalty", "logit_bias", "stream", "stream_options", "user", "echo",
                           "logprobs", "best_of", "suffix"}
_OPENAI_CHAT_ARGS = {"max_tokens", "max_completion_tokens", "n", "stop", "temperature", "top_p", "seed",
                     "presence_penalty", "frequency_penalty", "logit_bias", "stream", "stream_options", "user",
                     "logprobs", "top_logprobs", "response_format", "tools", "tool_choice", "parallel_tool_calls"}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def token_id(ctx: Ctx, text: str) -> int:
    (tid,) = ctx.tokenizer.encode(text, add_special_tokens=False)
    return tid


def text_of(out) -> str:
    return out.choices[0].text


def stream_chunks(ctx: Ctx, **kwargs) -> list:
    return list(ctx.complete(stream=True, **kwargs))


# ---- the checks, one per field ------------------------------------------------------------


def check_model(ctx: Ctx) -> None:
    assert ctx.greedy().model == MODEL  # the served name serves (every other check sends it)
    r = ctx.post(COMPLETIONS, {"prompt": PROMPT, "model": "another-model"})
    assert_error(r, 404, "model", "does not exist")


def check_prompt(ctx: Ctx) -> None:
    a, b = ctx.greedy(PROMPT), ctx.greedy(COUNTING)
    assert a.usage.prompt_tokens == len(ctx.tokenizer.encode(PROMPT))
    assert b.usage.prompt_tokens == len(ctx.tokenizer.encode(COUNTING))
    ids = ctx.tokenizer.encode(PROMPT)
    assert text_of(ctx.complete(ids)) == text_of(a)  # token ids: the same prompt


def check_max_tokens(ctx: Ctx) -> None:
    for n in (2, 5):
        assert ctx.complete(max_tokens=n, ignore_eos=True).usage.completion_tokens == n


def check_max_completion_tokens(ctx: Ctx) -> None:
    for n in (2, 5):
        out = ctx.chat(max_completion_tokens=n, max_tokens=None, ignore_eos=True)
        assert out.usage.completion_tokens == n


def check_n(ctx: Ctx) -> None:
    out = ctx.complete(n=3, temperature=1.0, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1


def check_stop(ctx: Ctx) -> None:
    full = text_of(ctx.greedy(COUNTING))  # " 5, 6, 7..."
    assert "," in full
    out = ctx.complete(COUNTING, stop=[","])
    assert text_of(out) == full[: full.index(",")]
    assert out.choices[0].finish_reason == "stop" and out.choices[0].model_extra["stop_reason"] == ","


def check_include_stop_str_in_output(ctx: Ctx) -> None:
    full = text_of(ctx.greedy(COUNTING))
    out = ctx.complete(COUNTING, stop=[","], include_stop_str_in_output=True)
    assert text_of(out) == full[: full.index(",") + 1]


def check_temperature(ctx: Ctx) -> None:
    greedy = text_of(ctx.greedy())
    assert text_of(ctx.complete(temperature=0)) == greedy
    hot = [text_of(ctx.complete(temperature=2.0, seed=s, max_tokens=6)) for s in (1, 2)]
    assert any(t != greedy for t in hot), hot


def check_top_p(ctx: Ctx) -> None:
    # Nucleus of (almost) zero mass: only the most likely token survives, as greedy.
    assert text_of(ctx.complete(temperature=1.0, top_p=1e-6, seed=3)) == text_of(ctx.greedy())


def check_top_k(ctx: Ctx) -> None:
    assert text_of(ctx.complete(temperature=1.0, top_k=1, seed=3)) == text_of(ctx.greedy())


def check_min_p(ctx: Ctx) -> None:
    assert text_of(ctx.complete(temperature=1.0, min_p=1.0, seed=3)) == text_of(ctx.greedy())


def check_seed(ctx: Ctx) -> None:
    a, b = (text_of(ctx.complete(temperature=1.0, seed=11, max_tokens=8)) for _ in range(2))
    assert a == b
    others = [text_of(ctx.complete(temperature=1.0, seed=s, max_tokens=8)) for s in (12, 13)]
    assert any(o != a for o in others), (a, others)


def _penalised(ctx: Ctx, **penalty: float) -> None:
    """Greedy repeats " Hello!" all along: a penalty on repeats must break the run."""
    prompt = "Hello! Hello! Hello! Hello!"
    base = text_of(ctx.complete(prompt, max_tokens=12))
    assert base.startswith(" Hello! Hello! Hello!"), base
    assert text_of(ctx.complete(prompt, max_tokens=12, **penalty)) != base


def check_presence_penalty(ctx: Ctx) -> None:
    _penalised(ctx, presence_penalty=2.0)


def check_frequency_penalty(ctx: Ctx) -> None:
    _penalised(ctx, frequency_penalty=2.0)


def check_repetition_penalty(ctx: Ctx) -> None:
    _penalised(ctx, repetition_penalty=2.0)


def check_logit_bias(ctx: Ctx) -> None:
    x = token_id(ctx, " x")
    out = ctx.complete(logit_bias={str(x): 100}, max_tokens=4, ignore_eos=True)
    assert text_of(out) == " x" * 4


def check_allowed_token_ids(ctx: Ctx) -> None:
    x = token_id(ctx, " x")
    assert text_of(ctx.complete(allowed_token_ids=[x], max_tokens=3, ignore_eos=True)) == " x" * 3


def check_bad_words(ctx: Ctx) -> None:
    assert "Paris" in text_of(ctx.greedy())
    assert "Paris" not in text_of(ctx.complete(bad_words=["Paris"]))


def check_ignore_eos(ctx: Ctx) -> None:
    base = ctx.greedy_chat()
    assert base.choices[0].finish_reason == "stop" and base.usage.completion_tokens < 6
    out = ctx.chat(ignore_eos=True)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6


def check_min_tokens(ctx: Ctx) -> None:
    assert ctx.greedy_chat().usage.completion_tokens < 5
    assert ctx.chat(min_tokens=5).usage.completion_tokens >= 5


def check_stop_token_ids(ctx: Ctx) -> None:
    comma = token_id(ctx, ",")
    out = ctx.complete(COUNTING, stop_token_ids=[comma])
    assert out.choices[0].finish_reason == "stop" and out.choices[0].model_extra["stop_reason"] == comma
    assert out.usage.completion_tokens < ctx.greedy(COUNTING).usage.completion_tokens


def _special_tokens_out(ctx: Ctx, **kwargs) -> str:
    # Force <|im_start|> three times: its text shows only when special tokens are kept.
    return text_of(ctx.complete(logit_bias={str(IM_START): 100}, max_tokens=3, ignore_eos=True, **kwargs))


def check_skip_special_tokens(ctx: Ctx) -> None:
    assert _special_tokens_out(ctx) == ""
    assert _special_tokens_out(ctx, skip_special_tokens=False) == "<|im_start|>" * 3


def check_spaces_between_special_tokens(ctx: Ctx) -> None:
    # SmolLM2's byte-level decoder puts no space between added tokens, so both settings give
    # the same text (as in vLLM); tests/engine/test_detokenizer.py shows the change on a
    # WordPiece tokenizer, whose decoder does.
    for spaces in (True, False):
        out = _special_tokens_out(ctx, skip_special_tokens=False, spaces_between_special_tokens=spaces)
        assert out == "<|im_start|>" * 3
    # With special tokens skipped the option has nothing to act on.
    assert _special_tokens_out(ctx, spaces_between_special_tokens=False) == ""


def check_stream(ctx: Ctx) -> None:
    chunks = stream_chunks(ctx)
    assert len(chunks) > 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text_of(ctx.greedy())


def check_stream_options(ctx: Ctx) -> None:
    ctx.refused(COMPLETIONS, {"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options", "stream=true")


def check_stream_options_include_usage(ctx: Ctx) -> None:
    assert all(c.usage is None for c in stream_chunks(ctx))
    chunks = stream_chunks(ctx, stream_options={"include_usage": True})
    assert all(c.usage is None for c in chunks[:-1]) and not chunks[-1].choices
    assert chunks[-1].usage == ctx.greedy().usage


def check_stream_options_continuous_usage_stats(ctx: Ctx) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = stream_chunks(ctx, stream_options=options)
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == ctx.greedy().usage.completion_tokens
    assert all(c.usage.prompt_tokens == ctx.greedy().usage.prompt_tokens for c in with_choices)
    assert chunks[-1].usage == ctx.greedy().usage
    chat = list(ctx.chat(stream=True, stream_options=options))
    assert all(c.usage is not None for c in chat) and chat[0].usage.completion_tokens == 0
    assert chat[-1].usage == ctx.greedy_chat().usage
    ctx.refused(COMPLETIONS, {"prompt": PROMPT, "stream": True, "stream_options": {"continuous_usage_stats": True}},
                "stream_options", "include_usage")


def check_user(ctx: Ctx) -> None:
    # OpenAI's end-user id, for the provider's monitoring: accepted, and it changes no output.
    assert text_of(ctx.complete(user="user-1234")) == text_of(ctx.greedy())


def check_cache_salt(ctx: Ctx) -> None:
    prompt = f"{uuid.uuid4().hex} " * 12  # fresh: nothing of it is cached yet; several full blocks

    def hits_after(salt: str) -> float:
        before = metric_value(metrics(ctx.server), "pagedllm:prefix_cache_hits_total") or 0.0
        ctx.complete(prompt, max_tokens=1, cache_salt=salt)
        deadline = time.monotonic() + 10
        while True:  # the stats arrive with the engine's next report
            delta = (metric_value(metrics(ctx.server), "pagedllm:prefix_cache_hits_total") or 0.0) - before
            if delta > 0 or time.monotonic() > deadline:
                return delta
            time.sleep(0.5)

    assert hits_after("salt-a") == 0
    assert hits_after("salt-b") == 0  # another salt shares nothing
    assert hits_after("salt-a") >= 32  # the same salt finds its blocks


def check_use_beam_search(ctx: Ctx) -> None:
    a = ctx.complete(n=2, use_beam_search=True, max_tokens=4)
    b = ctx.complete(n=2, use_beam_search=True, max_tokens=4)
    assert len(a.choices) == 2 and len({c.text for c in a.choices}) == 2
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    ctx.refused(COMPLETIONS, {"prompt": PROMPT, "use_beam_search": True, "top_k": 5}, "top_k", "beam search")


def check_length_penalty(ctx: Ctx) -> None:
    ctx.refused(COMPLETIONS, {"prompt": PROMPT, "length_penalty": 0.5}, "length_penalty", "beam search")
    ctx.refused(CHAT, {"messages": YES, "length_penalty": 2.0}, "length_penalty", "beam search")
    assert len(ctx.complete(n=2, use_beam_search=True, max_tokens=4, length_penalty=0.5).choices) == 2


def check_prompt_logprobs(ctx: Ctx) -> None:
    ids = ctx.tokenizer.encode(PROMPT)
    out = ctx.complete(prompt_logprobs=2, max_tokens=1)
    plp = out.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for token, position in zip(ids[1:], plp[1:]):
        assert str(token) in position and len(position) >= 2
        for entry in position.values():
            assert set(entry) == {"logprob", "rank", "decoded_token"} and entry["logprob"] <= 0
    assert (ctx.greedy().choices[0].model_extra or {}).get("prompt_logprobs") is None  # only when asked
    chat = ctx.chat(prompt_logprobs=0, max_tokens=1)
    top = chat.model_extra["prompt_logprobs"]
    assert len(top) == chat.usage.prompt_tokens and top[0] is None and all(len(p) == 1 for p in top[1:])
    ctx.refused(COMPLETIONS, {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream")


def check_request_id(ctx: Ctx) -> None:
    rid = f"my-request-{uuid.uuid4().hex[:8]}"
    assert ctx.complete(request_id=rid).id == rid


def check_response_format(ctx: Ctx) -> None:
    schema = {"type": "string", "enum": ["red", "green"]}
    out = ctx.chat(response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
                   max_tokens=8)
    assert json.loads(out.choices[0].message.content) in schema["enum"]


def check_structured_outputs(ctx: Ctx) -> None:
    assert text_of(ctx.complete(structured_outputs={"choice": ["alpha", "beta"]})) in ("alpha", "beta")


def check_guided_json(ctx: Ctx) -> None:
    schema = {"type": "string", "enum": ["left", "right"]}
    assert json.loads(text_of(ctx.complete(guided_json=schema, max_tokens=8))) in schema["enum"]


def check_guided_regex(ctx: Ctx) -> None:
    assert re.fullmatch(r"[0-9]{3}", text_of(ctx.complete(guided_regex=r"[0-9]{3}", max_tokens=8)))


def check_guided_choice(ctx: Ctx) -> None:
    assert text_of(ctx.complete(guided_choice=["yes", "no"])) in ("yes", "no")


def check_guided_grammar(ctx: Ctx) -> None:
    assert text_of(ctx.complete(guided_grammar='root ::= "ab" | "cd"')) in ("ab", "cd")


def check_kv_transfer_params(ctx: Ctx) -> None:
    body = {"prompt": PROMPT, "kv_transfer_params": {"do_remote_decode": True}}
    ctx.refused(COMPLETIONS, body, "kv_transfer_params", "kv-transfer-config")


def check_echo(ctx: Ctx) -> None:
    out = ctx.complete(echo=True)
    assert text_of(out) == PROMPT + text_of(ctx.greedy())
    ctx.refused(CHAT, {"messages": YES, "echo": True}, "echo", "not supported in chat")


def check_logprobs(ctx: Ctx) -> None:
    out = ctx.complete(logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == out.usage.completion_tokens and "".join(lp.tokens) == text_of(out)
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert ctx.greedy().choices[0].logprobs is None


def check_best_of(ctx: Ctx) -> None:
    assert text_of(ctx.complete(best_of=1)) == text_of(ctx.greedy())
    ctx.refused(COMPLETIONS, {"prompt": PROMPT, "best_of": 2}, "best_of", "not supported")


def check_suffix(ctx: Ctx) -> None:
    ctx.refused(COMPLETIONS, {"prompt": PROMPT, "suffix": "!"}, "suffix", "not supported")


def check_messages(ctx: Ctx) -> None:
    other = [{"role": "user", "content": "Name a colour, please, in one word."}]
    assert ctx.chat(other).usage.prompt_tokens > ctx.greedy_chat().usage.prompt_tokens


def check_chat_logprobs(ctx: Ctx) -> None:
    out = ctx.chat(logprobs=True)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens and all(c.top_logprobs == [] for c in content)
    assert ctx.greedy_chat().choices[0].logprobs is None


def check_top_logprobs(ctx: Ctx) -> None:
    out = ctx.chat(logprobs=True, top_logprobs=3)
    assert all(len(c.top_logprobs) == 3 for c in out.choices[0].logprobs.content)
    ctx.refused(CHAT, {"messages": YES, "top_logprobs": 2}, "top_logprobs", "logprobs")


def generation_prompt_tokens(ctx: Ctx) -> int:
    return len(ctx.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False))


def check_add_generation_prompt(ctx: Ctx) -> None:
    out = ctx.chat(add_generation_prompt=False, max_tokens=1)
    assert out.usage.prompt_tokens == ctx.greedy_chat().usage.prompt_tokens - generation_prompt_tokens(ctx)


def check_chat_template(ctx: Ctx) -> None:
    # Refused without --trust-request-chat-template; test_event_loop.py checks that a trusting
    # server renders it (prompt_tokens of the rendered text) and stops one that runs too long.
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    ctx.refused(CHAT, {"messages": YES, "chat_template": template}, "chat_template",
                "--trust-request-chat-template")


def check_chat_template_kwargs(ctx: Ctx) -> None:
    # The default template's one variable: overriding it changes the prompt (as vLLM lets it).
    out = ctx.chat(chat_template_kwargs={"add_generation_prompt": False}, max_tokens=1)
    assert out.usage.prompt_tokens == ctx.greedy_chat().usage.prompt_tokens - generation_prompt_tokens(ctx)
    ctx.refused(CHAT, {"messages": YES, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs",
                "tokenize")


def check_reasoning_effort(ctx: Ctx) -> None:
    # Handed to the chat template (gpt-oss's reads it: test_harmony_server.py); the default
    # model's template has no such variable, so its prompt is unchanged; other values are a 400.
    out = ctx.chat(reasoning_effort="high", max_tokens=1)
    assert out.usage.prompt_tokens == ctx.greedy_chat().usage.prompt_tokens
    ctx.refused(CHAT, {"messages": YES, "reasoning_effort": "extreme"}, "reasoning_effort")


def check_include_reasoning(ctx: Ctx) -> None:
    # Without --reasoning-parser nothing is reasoning: the field changes nothing here (what it
    # does with a parser: test_reasoning_server.py).
    message = ctx.chat(include_reasoning=False).choices[0].message
    assert message.content == ctx.greedy_chat().choices[0].message.content
    assert message.reasoning_content is None and ctx.greedy_chat().choices[0].message.reasoning_content is None


def check_thinking_token_budget(ctx: Ctx) -> None:
    # Without --reasoning-parser there is no reasoning to bound: a 400 naming the field, -1 (no
    # limit) accepted (the budget itself: test_reasoning_server.py).
    ctx.refused(CHAT, {"messages": YES, "thinking_token_budget": 8}, "thinking_token_budget", "--reasoning-parser")
    assert ctx.chat(thinking_token_budget=-1).choices[0].message.content == ctx.greedy_chat().choices[0].message.content


def check_priority(ctx: Ctx) -> None:
    # This server schedules FCFS: 0 is the default, anything else is refused (as vLLM); the
    # priority policy itself: test_vllm_launch.py and tests/core/test_priority_scheduler.py.
    assert text_of(ctx.complete(priority=0)) == text_of(ctx.greedy())
    ctx.refused(COMPLETIONS, {"prompt": PROMPT, "priority": 3}, "priority", "--scheduling-policy priority")
    ctx.refused(CHAT, {"messages": YES, "priority": -1}, "priority", "--scheduling-policy priority")


def check_truncate_prompt_tokens(ctx: Ctx) -> None:
    ids = ctx.tokenizer.encode(COUNTING)
    out = ctx.complete(COUNTING, truncate_prompt_tokens=3)
    assert out.usage.prompt_tokens == 3
    assert text_of(out) == text_of(ctx.complete(ids[-3:]))  # the last 3 tokens are what is kept
    assert ctx.complete(COUNTING, truncate_prompt_tokens=-1).usage.prompt_tokens == len(ids)  # -1: max_model_len
    assert ctx.chat(truncate_prompt_tokens=4).usage.prompt_tokens == 4
    ctx.refused(COMPLETIONS, {"prompt": PROMPT, "truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens",
                "max_model_len")
    ctx.refused(COMPLETIONS, {"prompt": PROMPT, "truncate_prompt_tokens": -2}, "truncate_prompt_tokens")


def check_return_token_ids(ctx: Ctx) -> None:
    plain = ctx.greedy().choices[0].model_extra or {}
    assert plain.get("token_ids") is None and plain.get("prompt_token_ids") is None  # only when asked
    out = ctx.complete(return_token_ids=True).choices[0]
    assert out.model_extra["prompt_token_ids"] == ctx.tokenizer.encode(PROMPT)
    token_ids = out.model_extra["token_ids"]
    assert ctx.tokenizer.decode(token_ids) == out.text == text_of(ctx.greedy())
    chunks = [c.choices[0] for c in stream_chunks(ctx, return_token_ids=True) if c.choices]
    assert [t for c in chunks for t in c.model_extra["token_ids"]] == token_ids
    assert [c.model_extra.get("prompt_token_ids") is not None for c in chunks] == [True] + [False] * (len(chunks) - 1)
    chat = ctx.chat(return_token_ids=True)
    assert len(chat.model_extra["prompt_token_ids"]) == chat.usage.prompt_tokens
    assert ctx.tokenizer.decode(chat.choices[0].model_extra["token_ids"], skip_special_tokens=True) == \
        chat.choices[0].message.content  # the ids include the EOS, as vLLM
    streamed = list(ctx.chat(return_token_ids=True, stream=True))
    assert streamed[0].model_extra["prompt_token_ids"] == chat.model_extra["prompt_token_ids"]
    ids = [t for c in streamed for ch in c.choices for t in (ch.model_extra.get("token_ids") or [])]
    assert ids == chat.choices[0].model_extra["token_ids"]


def check_add_special_tokens(ctx: Ctx) -> None:
    # The default model's tokenizer adds no special tokens, so both values encode alike here;
    # test_vllm_launch.py checks the field with a tokenizer that adds a BOS.
    assert ctx.complete(add_special_tokens=False).usage.prompt_tokens == len(
        ctx.tokenizer.encode(PROMPT, add_special_tokens=False))
    assert ctx.chat(add_special_tokens=True).usage.prompt_tokens == ctx.greedy_chat().usage.prompt_tokens
    ctx.refused(COMPLETIONS, {"prompt": PROMPT, "add_special_tokens": "maybe"}, "add_special_tokens")


def check_continue_final_message(ctx: Ctx) -> None:
    messages = [*YES, {"role": "assistant", "content": "Yes, and"}]
    text = ctx.tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith("Yes, and")  # left open: no end-of-turn after it
    out = ctx.chat(messages, continue_final_message=True, add_generation_prompt=False)
    assert out.usage.prompt_tokens == len(ctx.tokenizer.encode(text, add_special_tokens=False))
    closed = ctx.chat(messages, add_generation_prompt=False, max_tokens=1)
    assert closed.usage.prompt_tokens > out.usage.prompt_tokens
    ctx.refused(CHAT, {"messages": messages, "continue_final_message": True}, "continue_final_message",
                "add_generation_prompt")


def check_documents(ctx: Ctx) -> None:
    # The default template has no documents: the prompt stays as it was. A template that
    # renders them: test_vllm_launch.py.
    out = ctx.chat(documents=[{"title": "t", "text": "Paris is the capital of France."}])
    assert out.usage.prompt_tokens == ctx.greedy_chat().usage.prompt_tokens
    ctx.refused(CHAT, {"messages": YES, "documents": ["not an object"]}, "documents")


def _unsupported(name: str, value: object) -> Callable[[Ctx], None]:
    def check(ctx: Ctx) -> None:
        ctx.refused(CHAT, {"messages": YES, name: value}, name, "not supported")

    return check


def _refused_everywhere(name: str, value: object) -> Callable[[Ctx], None]:
    """A vLLM field this engine cannot honour: a 400 naming it, in completions and chat."""

    def check(ctx: Ctx) -> None:
        ctx.refused(COMPLETIONS, {"prompt": PROMPT, name: value}, name)
        ctx.refused(CHAT, {"messages": YES, name: value}, name)

    return check


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
PICK = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"color": {"enum": ["red", "green"]}}, "required": ["color"]}}}


def check_tools(ctx: Ctx) -> None:
    # tool_choice "none": the tools reach the prompt (the tool template), the answer is text.
    with_tools = ctx.chat(tools=[PICK], tool_choice="none", max_tokens=1)
    assert with_tools.usage.prompt_tokens > ctx.chat(max_tokens=1).usage.prompt_tokens
    assert with_tools.choices[0].message.tool_calls is None
    # Without a tool_choice tools mean "auto", which this server (no --enable-auto-tool-choice) refuses.
    ctx.refused(CHAT, {"messages": YES, "tools": [PICK]}, "tool_choice", "--enable-auto-tool-choice")


def check_tool_choice(ctx: Ctx) -> None:
    out = ctx.chat(tools=[TOOL, PICK], tool_choice={"type": "function", "function": {"name": "pick"}}, max_tokens=12)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "pick" and json.loads(call.function.arguments)["color"] in ("red", "green")
    assert out.choices[0].finish_reason == "tool_calls"


def check_parallel_tool_calls(ctx: Ctx) -> None:
    out = ctx.chat(tools=[PICK], tool_choice="required", parallel_tool_calls=False, max_tokens=24)
    (call,) = out.choices[0].message.tool_calls  # exactly one call: the grammar closes the list
    assert call.function.name == "pick"


FIELD_CHECKS: dict[str, Callable[[Ctx], None]] = {
    "model": check_model, "prompt": check_prompt, "max_tokens": check_max_tokens,
    "max_completion_tokens": check_max_completion_tokens, "n": check_n, "stop": check_stop,
    "include_stop_str_in_output": check_include_stop_str_in_output, "temperature": check_temperature,
    "top_p": check_top_p, "top_k": check_top_k, "min_p": check_min_p, "seed": check_seed,
    "presence_penalty": check_presence_penalty, "frequency_penalty": check_frequency_penalty,
    "repetition_penalty": check_repetition_penalty, "logit_bias": check_logit_bias,
    "allowed_token_ids": check_allowed_token_ids, "bad_words": check_bad_words, "ignore_eos": check_ignore_eos,
    "min_tokens": check_min_tokens, "stop_token_ids": check_stop_token_ids,
    "skip_special_tokens": check_skip_special_tokens,
    "spaces_between_special_tokens": check_spaces_between_special_tokens, "stream": check_stream,
    "stream_options": check_stream_options, "stream_options.include_usage": check_stream_options_include_usage,
    "stream_options.continuous_usage_stats": check_stream_options_continuous_usage_stats, "user": check_user,
    "cache_salt": check_cache_salt, "use_beam_search": check_use_beam_search,
    "length_penalty": check_length_penalty, "prompt_logprobs": check_prompt_logprobs,
    "request_id": check_request_id, "response_format": check_response_format,
    "structured_outputs": check_structured_outputs, "guided_json": check_guided_json,
    "guided_regex": check_guided_regex, "guided_choice": check_guided_choice,
    "guided_grammar": check_guided_grammar, "kv_transfer_params": check_kv_transfer_params,
    "echo": check_echo, "logprobs": check_logprobs, "best_of": check_best_of, "suffix": check_suffix,
    "messages": check_messages, "chat.logprobs": check_chat_logprobs, "top_logprobs": check_top_logprobs,
    "add_generation_prompt": check_add_generation_prompt, "chat_template": check_chat_template,
    "chat_template_kwargs": check_chat_template_kwargs,
    "include_reasoning": check_include_reasoning, "reasoning_effort": check_reasoning_effort,
    "thinking_token_budget": check_thinking_token_budget,
    "tools": check_tools, "tool_choice": check_tool_choice,
    "functions": _unsupported("functions", [TOOL["function"]]),
    "function_call": _unsupported("function_call", "auto"),
    "parallel_tool_calls": check_parallel_tool_calls,
    "priority": check_priority, "truncate_prompt_tokens": check_truncate_prompt_tokens,
    "return_token_ids": check_return_token_ids, "add_special_tokens": check_add_special_tokens,
    "continue_final_message": check_continue_final_message, "documents": check_documents,
    "logits_processors": _refused_everywhere("logits_processors", ["some.Processor"]),
    "return_tokens_as_token_ids": _refused_everywhere("return_tokens_as_token_ids", True),
    "vllm_xargs": _refused_everywhere("vllm_xargs", {"k": 1}),
    "prompt_embeds": lambda ctx: ctx.refused(COMPLETIONS, {"prompt": PROMPT, "prompt_embeds": "AAAA"},
                                             "prompt_embeds", "not supported"),
    "mm_processor_kwargs": lambda ctx: ctx.refused(CHAT, {"messages": YES, "mm_processor_kwargs": {}},
                                                   "mm_processor_kwargs", "multimodal"),
}


def protocol_fields() -> set[str]:
    names = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    names |= {f"stream_options.{n}" for n in StreamOptions.model_fields}
    names.add("chat.logprobs")  # chat's logprobs is a bool, completions' a count: both checked
    return names


def test_every_field_has_a_check():
    assert set(FIELD_CHECKS) == protocol_fields()


@pytest.fixture(scope="module")
def ctx(server, client, tokenizer) -> Ctx:
    return Ctx(server, client, tokenizer)


@pytest.mark.parametrize("field", sorted(FIELD_CHECKS))
def test_field_changes_what_it_should(ctx, field):
    FIELD_CHECKS[field](ctx)
