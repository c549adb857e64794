"""gpt-oss's harmony through the server (--reasoning-parser openai_gptoss --tool-call-parser
openai) with the official openai client, on a tiny model whose greedy output is fixed by its
weights (tests/reasoning/think_model.py) over the default tokenizer with harmony's markers
added as special tokens: "<|channel|>analysis<|message|>hello<|end|><|start|>assistant" again
and again. The markers reach the parser although they are special tokens (skipped from
output text by default), none leaks into reasoning or content, plain and streamed alike; and
``reasoning_effort`` reaches the chat template (which writes one word per level, so the
prompt's length shows the level). A second such model writes one commentary message to
`functions.get_time` and stops at <|call|>: one tool call, plain and streamed. More harmony
cases (analysis, then a call, then the final channel) are in test_tool_parsers.py and
tests/reasoning/test_parsers.py on fixed texts (a bigram model writes one cycle).

The same two chains from llama.cpp-style `gpt-oss` GGUF files (the bigram as a GptOssForCausalLM
with MXFP4 experts, tests/models/gpt_oss_gguf_utils.py), served from the file alone: its harmony
tokenizer (o200k's split, the markers as control tokens) and this chat template read from the
file's tokenizer keys.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

from tests.entrypoints.utils import RemoteServer
from tests.models.gpt_oss_gguf_utils import harmony_tokenizer, save_harmony_bigram
from tests.reasoning.think_model import save_think_model

MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
# "\n" only leads into the cycle; the prompt's last token ("assistant") starts it.
CHAIN = ["\n", "assistant", "<|channel|>", "analysis", "<|message|>", "hello", "<|end|>", "<|start|>"]
TEMPLATE = (
    "<|start|>system<|message|>Reasoning:{% set n = {'low': 1, 'medium': 2, 'high': 3}[reasoning_effort | default('medium')] %}"
    "{% for _ in range(n) %} effort{% endfor %}<|end|>"
    "{% if tools %}<|start|>developer<|message|># Tools{% for t in tools %} {{ t.function.name }}{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
CHAT = [{"role": "user", "content": "Hi"}]


# A second model: one commentary message to functions.get_time, its arguments "{}", then
# <|call|>, which ends the turn (an EOS id).
CALL_CHAIN = ["\n", "assistant", "<|channel|>", "commentary", " to=functions.get_time", "<|message|>", "{}", "<|call|>"]
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def _save(tmp_path_factory, default_tokenizer, chain: list[str]) -> tuple[str, object]:
    tokenizer = copy.deepcopy(default_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    # One token each, as in gpt-oss's vocabulary.
    tokenizer.add_tokens(["assistant", "analysis", "commentary", " to=functions.get_time", "{}"])
    tokenizer.chat_template = TEMPLATE
    path = tmp_path_factory.mktemp("harmony-model")
    save_think_model(path, tokenizer, chain)
    return str(path), tokenizer


def _serve(model_dir: str):
    import openai

    srv = RemoteServer(["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", "32MiB",
                        "--reasoning-parser", "openai_gptoss", "--enable-auto-tool-choice",
                        "--tool-call-parser", "openai"], model=model_dir)
    return srv, openai.OpenAI(base_url=srv.base_url, api_key="EMPTY", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory, default_tokenizer):
    return _save(tmp_path_factory, default_tokenizer, CHAIN)


@pytest.fixture(scope="module")
def client(harmony_dir):
    srv, client = _serve(harmony_dir[0])
    yield client
    srv.stop()


@pytest.fixture(scope="module")
def call_client(tmp_path_factory, default_tokenizer):
    srv, client = _serve(_save(tmp_path_factory, default_tokenizer, CALL_CHAIN)[0])
    yield client
    srv.stop()


def ask(client, streamed: bool, **kwargs):
    model = client.models.list().data[0].id
    if not streamed:
        chat = client.chat.completions.create(model=model, messages=CHAT, temperature=0.0, **kwargs)
        (choice,) = chat.choices
        return choice.message.reasoning, choice.message.content, choice.message.tool_calls or None
    reasoning, content, calls = "", "", {}  # index -> [id, name, arguments]
    for chunk in client.chat.completions.create(model=model, messages=CHAT, temperature=0.0, stream=True, **kwargs):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning", None) or ""
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:  # a call's first delta names it
                    calls[d.index] = [d.id, d.function.name, ""]
                calls[d.index][2] += d.function.arguments or ""
    merged = [SimpleNamespace(id=i, function=SimpleNamespace(name=n, arguments=a)) for i, n, a in calls.values()]
    return reasoning or None, content or None, merged or None


@pytest.mark.parametrize("streamed", [False, True])
def test_analysis_is_reasoning_and_markers_do_not_leak(client, streamed):
    # 7 tokens: one analysis message, then the next message's header (never content).
    assert ask(client, streamed, max_tokens=7) == ("hello", None, None)
    # Two messages on the analysis channel: both bodies are reasoning.
    assert ask(client, streamed, max_tokens=12) == ("hellohello", None, None)


def test_reasoning_effort_reaches_the_template(client, harmony_dir):
    _, tokenizer = harmony_dir
    model = client.models.list().data[0].id
    for effort in ("low", "medium", "high"):
        chat = client.chat.completions.create(
            model=model, messages=CHAT, temperature=0.0, max_tokens=1, reasoning_effort=effort)
        text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, reasoning_effort=effort)
        assert f"Reasoning:{' effort' * {'low': 1, 'medium': 2, 'high': 3}[effort]}<|end|>" in text
        assert chat.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False)), effort
    default = client.chat.completions.create(model=model, messages=CHAT, temperature=0.0, max_tokens=1)
    low = client.chat.completions.create(model=model, messages=CHAT, temperature=0.0, max_tokens=1, reasoning_effort="low")
    assert default.usage.prompt_tokens == low.usage.prompt_tokens + 1  # "medium": one word more


@pytest.mark.parametrize("streamed", [False, True])
def test_commentary_message_to_a_function_is_a_tool_call(call_client, streamed):
    reasoning, content, calls = ask(call_client, streamed, max_tokens=32, tools=TOOLS)
    assert (reasoning, content) == (None, None)
    assert calls is not None and len(calls) == 1
    assert (calls[0].function.name, calls[0].function.arguments) == ("get_time", "{}")
    assert calls[0].id.startswith("call_")


# One token each in the GGUF's vocabulary (plain added tokens: USER_DEFINED in the file).
GGUF_WORDS = ("assistant", "analysis", "commentary", " to=functions.get_time", "{}", "hello")


@pytest.fixture(scope="module", params=["analysis", "call"])
def gguf_client(request, tmp_path_factory):
    chain = CHAIN if request.param == "analysis" else CALL_CHAIN
    tokenizer = harmony_tokenizer(GGUF_WORDS, TEMPLATE)
    path = save_harmony_bigram(tmp_path_factory.mktemp("harmony-gguf"), tokenizer, chain)
    srv, client = _serve(str(path))
    yield request.param, client
    srv.stop()


@pytest.mark.parametrize("streamed", [False, True])
def test_gpt_oss_gguf_harmony_reasoning_and_tool_call(gguf_client, streamed):
    kind, client = gguf_client
    assert client.models.list().data[0].id.endswith("model.gguf")
    if kind == "analysis":
        assert ask(client, streamed, max_tokens=7) == ("hello", None, None)
        assert ask(client, streamed, max_tokens=12, reasoning_effort="high") == ("hellohello", None, None)
        return
    reasoning, content, calls = ask(client, streamed, max_tokens=32, tools=TOOLS)
    assert (reasoning, content) == (None, None)
    assert calls is not None and len(calls) == 1
    assert (calls[0].function.name, calls[0].function.arguments) == ("get_time", "{}")
