"""Structured outputs on the real default model: sampled at temperature 1.0, every output
follows its JSON schema / regex / choice / grammar and ends with finish_reason "stop";
unconstrained requests in the same batch are unaffected; invalid specs raise ValueError."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedllm import SamplingParams, StructuredOutputsParams
from tests.structured_output.schemas import SCHEMAS

SO = StructuredOutputsParams


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _assert_all_blocks_free(llm) -> None:
    kv = llm.llm_engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1, "KV blocks left behind"
    assert not llm.llm_engine.engine_core.has_unfinished_requests()
    assert llm.llm_engine.engine_core.structured_output.num_matchers == 0, "matchers left behind"


def whitespace_outside_strings(text: str) -> list[int]:
    """Offsets of whitespace characters outside JSON string literals."""
    found, in_string, escaped = [], False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch.isspace():
            found.append(i)
    return found


@pytest.mark.slow
def test_twenty_json_schemas_all_valid_at_temperature_1(default_llm):
    conversations = [
        _chat(f"Reply with JSON describing {what}.") for what, _ in SCHEMAS
    ]
    params = [
        SamplingParams(temperature=1.0, max_tokens=400, seed=100 + i, structured_outputs=SO(json=schema))
        for i, (_, schema) in enumerate(SCHEMAS)
    ]
    outputs = default_llm.chat(conversations, params, use_tqdm=False)
    for (what, schema), out in zip(SCHEMAS, outputs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (what, c.text)
        document = json.loads(c.text)
        jsonschema.validate(document, schema)
        assert whitespace_outside_strings(c.text) == [], (what, c.text)
    _assert_all_blocks_free(default_llm)


REGEXES = [
    r"\(\d{3}\) \d{3}-\d{4}",
    r"[a-z]{3,8}@[a-z]{3,6}\.(com|org|net)",
    r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d)",
    r"#[0-9a-fA-F]{6}",
]
CHOICES = [["yes", "no"], ['say "hi"', "back\\slash", "café ☕", "two\nlines"], ["Paris", "London", "Berlin", "Rome"]]
# An EBNF grammar and the same language as a Python regex.
GRAMMAR = """
root ::= sum " = ?"
sum ::= num (op num){0,3}
op ::= " + " | " - " | " * "
num ::= [1-9] [0-9]{0,2}
"""
GRAMMAR_REGEX = r"[1-9][0-9]{0,2}(( \+ | - | \* )[1-9][0-9]{0,2}){0,3} = \?"


@pytest.mark.slow
def test_regex_choice_and_grammar_outputs_match(default_llm):
    cases = (
        [(SO(regex=r), lambda t, r=r: re.fullmatch(r, t) is not None) for r in REGEXES]
        + [(SO(choice=c), lambda t, c=c: t in c) for c in CHOICES]
        + [(SO(grammar=GRAMMAR), lambda t: re.fullmatch(GRAMMAR_REGEX, t) is not None)]
    )
    prompt = _chat("Give me an example value.")
    params = [SamplingParams(temperature=1.0, max_tokens=64, seed=7 + i, n=3, structured_outputs=spec)
              for i, (spec, _) in enumerate(cases)]
    outputs = default_llm.chat([prompt] * len(cases), params, use_tqdm=False)
    for (spec, matches), out in zip(cases, outputs):
        for c in out.outputs:
            assert c.finish_reason == "stop", (spec, c.text)
            assert matches(c.text), (spec, c.text)
    _assert_all_blocks_free(default_llm)


def _top2_gaps(completion) -> list[float]:
    gaps = []
    for position in completion.logprobs:
        top = sorted(position.values(), key=lambda lp: lp.rank)
        gaps.append(top[0].logprob - top[1].logprob)
    return gaps


@pytest.mark.slow
def test_mixed_batch_leaves_unconstrained_outputs_unchanged(default_llm):
    from tests.utils import assert_same_greedy

    questions = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about rain."]
    free = SamplingParams(temperature=0.0, max_tokens=32, logprobs=2)
    alone = default_llm.chat([_chat(q) for q in questions], free, use_tqdm=False)
    constrained = [
        SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=SO(json=SCHEMAS[0][1])),
        SamplingParams(temperature=1.0, max_tokens=64, seed=3, structured_outputs=SO(regex=REGEXES[0])),
        SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=SO(choice=CHOICES[2])),
    ]
    mixed_convs = [_chat(q) for q in questions] + [_chat("Answer in the requested format.")] * len(constrained)
    mixed = default_llm.chat(mixed_convs, [free] * len(questions) + constrained, use_tqdm=False)
    for q, a, b in zip(questions, alone, mixed):
        ref = a.outputs[0]
        assert_same_greedy(b.outputs[0].token_ids, ref.token_ids, _top2_gaps(ref), q)
    jsonschema.validate(json.loads(mixed[3].outputs[0].text), SCHEMAS[0][1])
    assert re.fullmatch(REGEXES[0], mixed[4].outputs[0].text)
    assert mixed[5].outputs[0].text in CHOICES[2]
    _assert_all_blocks_free(default_llm)


@pytest.mark.slow
def test_n_greater_than_one_each_sequence_follows_the_schema(default_llm):
    schema = SCHEMAS[1][1]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=200, seed=5, structured_outputs=SO(json=schema))
    (out,) = default_llm.chat([_chat("Reply with JSON describing a book.")], params, use_tqdm=False)
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)
    assert len({c.text for c in out.outputs}) > 1, "the sequences did not sample independently"
    _assert_all_blocks_free(default_llm)


def test_grammar_ends_the_request_even_with_ignore_eos(default_llm):
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, structured_outputs=SO(choice=CHOICES[2]))
    (out,) = default_llm.chat([_chat("Which city is the capital of Italy?")], params, use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.text in CHOICES[2], c
    assert len(c.token_ids) < 50
    _assert_all_blocks_free(default_llm)


class Pet:  # stands in for a pydantic model: a class with model_json_schema()
    @staticmethod
    def model_json_schema() -> dict:
        return SCHEMAS[13][1]


def test_json_accepts_a_string_and_a_pydantic_model_class():
    import pydantic

    class Point(pydantic.BaseModel):
        x: int
        y: int

    assert SO(json=Point).json == Point.model_json_schema()
    assert SO(json='{"type": "integer"}').json == {"type": "integer"}
    assert SO(json=Pet).key == SO(json=json.dumps(SCHEMAS[13][1])).key


@pytest.mark.parametrize("spec,message", [
    (dict(json={"type": "frobnicate"}), "structured_outputs.json"),
    (dict(regex="(unclosed"), "structured_outputs.regex"),
    (dict(grammar='root ::= missing_rule'), "structured_outputs.grammar"),
    (dict(grammar="not a grammar at all"), "structured_outputs.grammar"),
])
def test_invalid_specs_raise_value_error_and_nothing_else_is_affected(default_llm, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        default_llm.generate(["Hi"], SamplingParams(max_tokens=4, structured_outputs=SO(**spec)), use_tqdm=False)
    (out,) = default_llm.generate(["Hi"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
    _assert_all_blocks_free(default_llm)


@pytest.mark.parametrize("kwargs,message", [
    (dict(json='{"type": '), "not valid JSON"),
    (dict(json=42), "JSON schema"),
    (dict(regex="a", choice=["a"]), "exactly one"),
    (dict(), "exactly one"),
    (dict(choice=[]), "non-empty list"),
])
def test_malformed_params_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SO(**kwargs)


def test_min_tokens_and_structured_outputs_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=SO(regex="a+"))


def test_request_waiting_for_its_grammar_does_not_block_others(default_llm):
    from concurrent.futures import Future

    engine = default_llm.llm_engine
    manager = engine.engine_core.structured_output
    spec = SO(regex=r"[0-9]{4}")
    compiled = manager.compile(spec).result()
    # Hold the compile "in flight": the spec's cache entry is a future we complete later.
    in_flight: Future = Future()
    manager._grammars[spec.key] = in_flight
    finished = {}
    try:
        slow_id = engine.add_request("The year was", SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=spec))
        fast_id = engine.add_request("Hello", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        while fast_id not in finished:
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
        assert slow_id not in finished
        assert engine.engine_core.get_stats().num_waiting == 1
        assert engine.scheduler.get_num_unfinished_requests() == 0  # kept out of the scheduler
    finally:
        in_flight.set_result(compiled)
        while engine.has_unfinished_requests():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
    slow = finished[slow_id].outputs[0]
    assert slow.finish_reason == "stop" and re.fullmatch(r"[0-9]{4}", slow.text), slow
    assert len(finished[fast_id].outputs[0].token_ids) == 3
    _assert_all_blocks_free(default_llm)


def test_grammar_past_its_compile_deadline_fails_its_request_and_an_abort_cancels_a_queued_compile(
        default_llm, monkeypatch):
    """Issue 48: a request whose grammar has not compiled by GRAMMAR_COMPILE_TIMEOUT_S fails
    with an error naming the limit (the server's 400), its blocks untouched; an aborted
    request's compile that has not started is cancelled and forgotten (no thread taken)."""
    import time
    from concurrent.futures import Future

    from pagedllm.engine import engine_core as core_module

    engine = default_llm.llm_engine
    core = engine.engine_core
    manager = core.structured_output
    monkeypatch.setattr(core_module, "GRAMMAR_COMPILE_TIMEOUT_S", 0.3, raising=False)
    # A compile that never ends (the spec's cache entry is a future nobody completes).
    never: Future = Future()
    spec = SO(regex=r"[0-9]{5}")
    manager._grammars[spec.key] = never
    slow_id = engine.add_request("The code is", SamplingParams(max_tokens=8, structured_outputs=spec))
    errors: dict = {}
    t0 = time.monotonic()
    while not errors and time.monotonic() - t0 < 10:
        errors.update((o.request_id, o.error) for o in core.step() if o.error)
        time.sleep(0.02)
    engine.output_processor.abort_requests([slow_id])
    assert any("did not compile within 0.3 s" in e for e in errors.values()), errors
    assert not core.has_unfinished_requests()
    # Aborted while its compile waits for a thread: the compile is cancelled and forgotten.
    queued: Future = Future()
    spec2 = SO(regex=r"[a-z]{5}")
    manager._grammars[spec2.key] = queued
    rid = engine.add_request("Hello", SamplingParams(max_tokens=8, structured_outputs=spec2))
    core.step()
    engine.abort_request([rid])
    assert queued.cancelled()
    assert spec2.key not in manager._grammars
    never.cancel()
    manager._grammars.pop(spec.key, None)
    _assert_all_blocks_free(default_llm)
