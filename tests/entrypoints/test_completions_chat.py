"""The server through the official openai client: completions and chat, streamed and not."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.conftest import MODEL

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_health_version_models(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_stream_equals_non_stream(client, tokenizer):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    choice = full.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage is not None and chunks[-1].usage == full.usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    # Usage matches the tokenizer: the prompt with its BOS, the output token by token.
    assert full.usage.prompt_tokens == len(tokenizer.encode(PROMPT, add_special_tokens=True))
    assert 0 < full.usage.completion_tokens <= 16
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens


def test_completion_usage_counts_every_output_token(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 7


def test_chat_names_paris(client, tokenizer):
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32, temperature=0)
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].message.role == "assistant"
    ids = tokenizer.apply_chat_template(QUESTION, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert out.usage.prompt_tokens == len(ids)


def test_chat_stream_equals_non_stream(client):
    messages = [{"role": "user", "content": "Name three colours."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage == full.usage
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason


def test_max_completion_tokens(client):
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_completion_tokens=3, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_stop_string(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    words = base.split()
    assert len(words) >= 3, base
    stop = words[2]
    cut = base.index(stop)
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                        stream=stream, extra_body={"ignore_eos": True})
        if stream:
            chunks = list(out)
            text = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = out.choices[0].text, out.choices[0].finish_reason
        assert text == base[:cut], (stream, text, base)
        assert finish == "stop"


def test_token_id_prompts_and_lists(client, tokenizer):
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1]
    assert many.usage.prompt_tokens == len(ids) + 3
    assert many.usage.completion_tokens == 8
    texts = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=4, temperature=0)
    assert len(texts.choices) == 2 and texts.choices[0].text == by_text.choices[0].text[: len(texts.choices[0].text)]


def test_echo(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert out.choices[0].text.startswith(PROMPT) and len(out.choices[0].text) > len(PROMPT)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream) == out.choices[0].text


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0.9, seed=1234,
                  extra_body={"top_k": 50})
    a = client.completions.create(**kwargs).choices[0].text
    b = client.completions.create(**kwargs).choices[0].text
    assert a == b


def test_tokenize_detokenize(server, tokenizer):
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT})
    assert r.status_code == 200
    tokens = r.json()["tokens"]
    assert tokens == tokenizer.encode(PROMPT, add_special_tokens=True)
    assert r.json()["count"] == len(tokens) and r.json()["max_model_len"] == 2048
    r = httpx.post(server.url + "/detokenize", json={"tokens": tokens})
    assert r.status_code == 200 and r.json()["prompt"] == tokenizer.decode(tokens)
    r = httpx.post(server.url + "/tokenize", json={"messages": QUESTION})
    assert r.status_code == 200 and r.json()["count"] > len(tokens)


def test_n2_usage_summed(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, n=2, seed=7,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 12
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, n=2, temperature=1.0,
                                          extra_body={"ignore_eos": True})
    assert len(chat.choices) == 2 and chat.usage.completion_tokens == 10
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, n=2,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    assert chunks[-1].usage.completion_tokens == 12


def test_logprobs_shapes(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(len(t) >= 3 for t in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    assert all(abs(max(t.values()) - v) < 1e-4 for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
