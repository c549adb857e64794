"""/v1/responses with the official openai client (and the OpenAI Agents SDK) against a real
server on the default model: plain and streamed (each event parsed as the SDK's own event
types, sequence numbers in order, the streamed text equal to the plain one), a function tool
round trip (forced, so deterministic) through previous_response_id and through the full
input, text.format json_schema, max_output_tokens as an incomplete response, the store's
GET / DELETE / eviction, and errors in OpenAI's shape. The server runs with
--enable-prompt-tokens-details: the prefix cache's share of the prompt in each route's usage."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import pytest

from tests.entrypoints.utils import SMALL_SERVER_ARGS, RemoteServer

TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                       "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def responses_server():
    srv = RemoteServer([*SMALL_SERVER_ARGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--max-stored-responses", "4", "--enable-prompt-tokens-details"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(responses_server):
    import openai

    return openai.OpenAI(base_url=responses_server.base_url, api_key="EMPTY", max_retries=0, timeout=120)


MODEL = "SmolLM2-135M-Instruct"


def sdk_event_types() -> dict[str, type]:
    """The SDK's stream event classes by their ``type``."""
    import typing

    from openai.types.responses import ResponseStreamEvent

    union = typing.get_args(ResponseStreamEvent)[0]
    return {typing.get_args(cls.model_fields["type"].annotation)[0]: cls for cls in typing.get_args(union)}


def raw_events(server, body: dict) -> list[dict]:
    """The stream's events as sent (JSON), each checked against the SDK's class for its type."""
    classes = sdk_event_types()
    events = []
    with httpx.stream("POST", server.base_url + "/responses", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                classes[event["type"]].model_validate(event, strict=False)
                events.append(event)
    return events


def test_plain_and_streamed_agree(client, responses_server):
    kwargs = dict(model=MODEL, input="Say hello.", instructions="Be brief.", temperature=0.0, max_output_tokens=12)
    plain = client.responses.create(**kwargs)
    assert plain.object == "response" and plain.status == "incomplete"
    assert plain.incomplete_details.reason == "max_output_tokens"
    assert plain.usage.output_tokens == 12 and plain.output_text
    (item,) = plain.output
    assert item.type == "message" and item.content[0].type == "output_text"

    raw = raw_events(responses_server, kwargs)  # each validated against the SDK's own model
    events = list(client.responses.create(stream=True, **kwargs))
    assert [e["type"] for e in raw] == [e.type for e in events]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 1
    for kind in ("response.content_part.added", "response.output_text.done", "response.content_part.done"):
        assert kinds.count(kind) == 1, kind
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text
    final = events[-1].response
    assert final.output_text == text and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == 12


def test_cached_tokens_in_usage(client):
    """A prompt sent again is served from the prefix cache: usage says how much of it, in
    chat's and completions' prompt_tokens_details (plain and streamed) and in the Responses
    input_tokens_details."""
    long_prompt = "Here is a long note to read twice so its blocks are cached. " * 6
    messages = [{"role": "user", "content": long_prompt}]
    chat = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
            for _ in range(2)]
    assert chat[1].usage.prompt_tokens_details.cached_tokens >= 16, chat[1].usage
    assert chat[1].usage.prompt_tokens_details.cached_tokens <= chat[1].usage.prompt_tokens
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens >= 16, streamed[-1].usage
    text = "Completions: " + long_prompt
    completions = [client.completions.create(model=MODEL, prompt=text, max_tokens=2, temperature=0) for _ in range(2)]
    assert completions[1].usage.prompt_tokens_details.cached_tokens >= 16, completions[1].usage
    responses = [client.responses.create(model=MODEL, input="Responses: " + long_prompt, max_output_tokens=2,
                                         temperature=0) for _ in range(2)]
    assert responses[1].usage.input_tokens_details.cached_tokens >= 16, responses[1].usage
    events = list(client.responses.create(model=MODEL, input="Responses: " + long_prompt, max_output_tokens=2,
                                          temperature=0, stream=True))
    assert events[-1].type == "response.incomplete"  # cut by max_output_tokens
    assert events[-1].response.usage.input_tokens_details.cached_tokens >= 16, events[-1].response.usage


def test_completed_status_and_get(client):
    r = client.responses.create(model=MODEL, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Answer yes or no: is the sky blue?"}]}],
        temperature=0.0, max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "answer", "strict": True, "schema": {
            "type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
            "additionalProperties": False}}})
    assert r.status == "completed" and r.incomplete_details is None
    jsonschema.validate(json.loads(r.output_text), {"type": "object", "required": ["answer"]})
    again = client.responses.retrieve(r.id)
    assert again.id == r.id and again.output_text == r.output_text and again.status == "completed"


def _forced_call(client, **kwargs):
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[TOOL],
                                tool_choice="required", temperature=0.0, max_output_tokens=60, **kwargs)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and r.status == "completed"
    jsonschema.validate(json.loads(call.arguments), TOOL["parameters"])
    return r, call


def test_function_tool_round_trip_with_previous_response_id(client):
    first, call = _forced_call(client)
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[TOOL], tool_choice="none", temperature=0.0,
        max_output_tokens=16,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}])
    assert second.previous_response_id == first.id and second.output_text
    assert [o.type for o in second.output] == ["message"]
    # The same turn with the whole conversation sent instead: the same prompt, the same answer.
    full = client.responses.create(
        model=MODEL, tools=[TOOL], tool_choice="none", temperature=0.0, max_output_tokens=16,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}])
    assert full.output_text == second.output_text
    assert full.usage.input_tokens == second.usage.input_tokens


def test_streamed_function_call_events(client):
    events = list(client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[TOOL], tool_choice="required",
        temperature=0.0, max_output_tokens=60, stream=True))
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.completed"
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == done.arguments and done.name == "get_weather"
    (call,) = [o for o in events[-1].response.output if o.type == "function_call"]
    assert call.arguments == done.arguments and call.call_id


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=MODEL, input="My name is Ada.", temperature=0.0, max_output_tokens=8)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     temperature=0.0, max_output_tokens=8)
    alone = client.responses.create(model=MODEL, input="What is my name?", temperature=0.0, max_output_tokens=8)
    # The history is in the prompt: the first turn's input and output tokens precede the question.
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens


def test_store_delete_evict_and_errors(client, responses_server):
    import openai

    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    assert e.value.body["message"].startswith("no response with id")
    first = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    for _ in range(4):  # --max-stored-responses 4: the oldest goes
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="Hi", previous_response_id=first.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Hi", tools=[{"type": "web_search"}])
    assert e.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError):  # a finished response cannot be cancelled
        client.responses.cancel(client.responses.create(model=MODEL, input="Hi", max_output_tokens=2).id)
    body = httpx.post(responses_server.base_url + "/responses", json={"input": "Hi", "text": {
        "format": {"type": "yaml"}}}).json()
    assert body["error"]["type"] == "BadRequestError" and body["error"]["param"] == "text"


def test_openai_agents_sdk_runs_a_tool(client, responses_server):
    """The OpenAI Agents SDK's Runner over OpenAIResponsesModel: the forced first turn calls the
    tool, the SDK runs it and sends its output back, and the agent's final answer follows
    (the SDK resets tool_choice after a tool call, so the second turn answers in text)."""
    agents = pytest.importorskip("agents")
    import openai

    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    model = agents.OpenAIResponsesModel(
        model=MODEL, openai_client=openai.AsyncOpenAI(base_url=responses_server.base_url, api_key="EMPTY",
                                                      max_retries=0, timeout=120))
    agent = agents.Agent(name="weather", instructions="Answer with the weather.", model=model, tools=[get_weather],
                         model_settings=agents.ModelSettings(tool_choice="required", temperature=0.0,
                                                             max_tokens=200))
    agents.set_tracing_disabled(True)
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert len(calls) == 1
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert isinstance(result.final_output, str) and result.final_output


def test_cancel_in_progress(client, responses_server):
    """POST /v1/responses/{id}/cancel stops a response still generating (streamed, or plain
    under a request_id known beforehand): its status becomes cancelled, its engine request ends."""
    import threading

    stream = client.responses.create(model=MODEL, input="Count to a thousand.", max_output_tokens=1500,
                                     temperature=0.0, stream=True)
    events = iter(stream)
    created = next(events)
    assert created.type == "response.created"
    response_id = created.response.id
    next(events)
    assert client.responses.cancel(response_id).status == "cancelled"
    rest = list(events)
    assert all(e.type not in ("response.completed", "response.incomplete") for e in rest)
    assert client.responses.retrieve(response_id).status == "cancelled"

    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
        responses_server.base_url + "/responses", timeout=120,
        json={"input": "Count to a thousand.", "max_output_tokens": 1500, "request_id": "resp-to-cancel"})))
    worker.start()
    for _ in range(100):
        r = httpx.post(responses_server.base_url + "/responses/resp-to-cancel/cancel")
        if r.status_code == 200:
            break
        time.sleep(0.05)
    assert r.json()["status"] == "cancelled"
    worker.join()
    assert result["r"].json()["status"] == "cancelled"
    # The server goes on serving.
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=2).status == "incomplete"


def test_a_stream_left_early_is_stored_as_failed(client, responses_server):
    with httpx.stream("POST", responses_server.base_url + "/responses", timeout=120, json={
            "input": "Count to a thousand.", "max_output_tokens": 1500, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                response_id = json.loads(line[6:])["response"]["id"]
                break
    for _ in range(100):
        stored = client.responses.retrieve(response_id)
        if stored.status != "in_progress":
            break
        time.sleep(0.05)
    assert stored.status == "failed" and "disconnected" in stored.error.message
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=2).status == "incomplete"
