"""OpenAI's Responses API end to end: a live `roseinfer serve` on the default model driven by the
official `openai` client (`responses.create`, `.stream`, `.parse`, `.retrieve`, `.delete`), each
answer checked against /v1/chat/completions with the same conversation at temperature 0 (the
same engine path, so the same tokens); and the output builder's event order on its own."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from live_server import ServerProcess
from pydantic import BaseModel, Field
from support import EXACT_FLAGS

from roseinfer.server.responses_output import OutputBuilder
from roseinfer.tool_parsers import ContentDelta, ToolCallDelta

MODEL = "SmolLM2-135M-Instruct"
CITY = {"type": "string", "minLength": 1, "maxLength": 24}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": CITY}, "required": ["city"],
                          "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "description": "The time in a city",
        "parameters": {"type": "object", "properties": {"city": CITY}, "required": ["city"],
                       "additionalProperties": False}}


def chat_tool(tool: dict) -> dict:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = ServerProcess("--kv-cache-memory", "0.25", *EXACT_FLAGS)
    yield process
    assert process.stop() == 0, process.output()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int, **extra) -> tuple[str, object]:
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                           **extra)
    return reply.choices[0].message.content, reply


# -- create -------------------------------------------------------------------------------------

def test_string_input_equals_the_chat_route_with_usage(client):
    question = "What is the capital of France?"
    response = client.responses.create(model=MODEL, input=question, max_output_tokens=48, temperature=0)
    text, chat = chat_text(client, [{"role": "user", "content": question}], 48)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert response.output_text == text and text
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    expected = "completed" if chat.choices[0].finish_reason == "stop" else "incomplete"
    assert response.status == message.status == expected


def test_items_input_with_instructions_equals_a_system_message(client):
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "My name is Ada."}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello Ada!"}]},
        {"type": "message", "role": "user", "content": "What is my name?"},
    ]
    response = client.responses.create(model=MODEL, input=items, instructions="You are a terse assistant.",
                                       max_output_tokens=24, temperature=0)
    text, _ = chat_text(client, [{"role": "system", "content": "You are a terse assistant."},
                                 {"role": "user", "content": "My name is Ada."},
                                 {"role": "assistant", "content": "Hello Ada!"},
                                 {"role": "user", "content": "What is my name?"}], 24)
    assert response.output_text == text and response.instructions == "You are a terse assistant."


def test_max_output_tokens_makes_it_incomplete(client):
    response = client.responses.create(model=MODEL, input="Write a long story about the sea.", max_output_tokens=5,
                                       temperature=0, metadata={"ticket": "42"})
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.usage.output_tokens == 5
    assert response.metadata == {"ticket": "42"} and response.max_output_tokens == 5


# -- stream -------------------------------------------------------------------------------------

def test_stream_events_in_order_add_up_to_the_whole_response(client):
    kwargs = dict(model=MODEL, input="Say hello in one short sentence.", max_output_tokens=64, temperature=0)
    whole = client.responses.create(**kwargs)
    assert whole.status == "completed", "the prompt must end by itself for response.completed"
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text == final.output_text
    assert events[0].response.status == "in_progress" and final.status == "completed"
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.id == events[0].response.id != whole.id


def test_a_stream_cut_by_max_output_tokens_ends_with_response_incomplete(server):
    body = {"model": MODEL, "input": "Write a long story about the sea.", "max_output_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=120) as reply:
        lines = [line for line in reply.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in datas] and names[-1] == "response.incomplete"
    last = datas[-1]["response"]
    assert last["status"] == "incomplete" and last["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["usage"]["output_tokens"] == 4 and last["output"][0]["status"] == "incomplete"


# -- structured outputs and tools -----------------------------------------------------------------

def test_parse_with_a_pydantic_model(client):
    class Book(BaseModel):
        title: str = Field(max_length=40)
        year: int = Field(ge=1000, le=2100)

    parsed = client.responses.parse(model=MODEL, input="Describe a famous book.", text_format=Book,
                                    max_output_tokens=100, temperature=0)
    assert isinstance(parsed.output_parsed, Book) and parsed.status == "completed"
    json_object = client.responses.create(model=MODEL, input="Return a JSON object with keys city and country "
                                          "for Paris.", text={"format": {"type": "json_object"}},
                                          max_output_tokens=100, temperature=0)
    assert isinstance(json.loads(json_object.output_text), dict)


def test_a_function_tool_round_trip(client):
    question = "What is the weather in Paris?"
    first = client.responses.create(model=MODEL, input=question, tools=[WEATHER, TIME], tool_choice="required",
                                    max_output_tokens=150, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status == "completed" and all(item.type == "function_call" for item in first.output)
    schemas = {t["name"]: t["parameters"] for t in (WEATHER, TIME)}
    for call in calls:
        assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    # The same calls as the chat route makes.
    _, chat = chat_text(client, [{"role": "user", "content": question}], 150,
                        tools=[chat_tool(WEATHER), chat_tool(TIME)], tool_choice="required")
    assert [(c.name, c.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in chat.choices[0].message.tool_calls]

    results = [{"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}
               for call in calls]
    by_id = client.responses.create(model=MODEL, previous_response_id=first.id, input=results,
                                    tools=[WEATHER, TIME], tool_choice="none", max_output_tokens=20, temperature=0)
    items = [{"role": "user", "content": question}, *[call.model_dump(exclude_none=True) for call in calls], *results]
    by_items = client.responses.create(model=MODEL, input=items, tools=[WEATHER, TIME], tool_choice="none",
                                       max_output_tokens=20, temperature=0)
    reference, _ = chat_text(client, [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]},
        *({"role": "tool", "tool_call_id": c.call_id, "content": "18 C and sunny"} for c in calls),
    ], 20, tools=[chat_tool(WEATHER), chat_tool(TIME)], tool_choice="none")
    assert by_id.output_text == by_items.output_text == reference and reference
    assert by_id.previous_response_id == first.id


def test_a_named_function_streams_its_arguments(client):
    kwargs = dict(model=MODEL, input="What time is it in Oslo?", tools=[WEATHER, TIME],
                  tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=100, temperature=0)
    whole = client.responses.create(**kwargs)
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "get_time"
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    deltas = kinds.count("response.function_call_arguments.delta")
    assert deltas >= 1 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * deltas, "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    done = events[-3]
    assert done.arguments == call.arguments and done.name == "get_time"
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments


# -- the store ----------------------------------------------------------------------------------

def test_previous_response_id_retrieve_and_delete(client):
    first = client.responses.create(model=MODEL, input="My favourite colour is green.", max_output_tokens=16,
                                    temperature=0, instructions="Be brief.")
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="What is my favourite colour?",
                                     max_output_tokens=16, temperature=0)
    # Instructions are not carried over, as OpenAI documents.
    reference, _ = chat_text(client, [{"role": "user", "content": "My favourite colour is green."},
                                      {"role": "assistant", "content": first.output_text},
                                      {"role": "user", "content": "What is my favourite colour?"}], 16)
    assert second.output_text == reference

    fetched = client.responses.retrieve(first.id)
    assert fetched.model_dump() == first.model_dump()
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(first.id)
    assert gone.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL, previous_response_id=first.id, input="Hi", max_output_tokens=2)
    assert missing.value.body["code"] == "previous_response_not_found"
    # A continuation of a continuation still holds the whole conversation.
    third = client.responses.create(model=MODEL, previous_response_id=second.id, input="Thanks.",
                                    max_output_tokens=8, temperature=0)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens

    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


# -- errors -------------------------------------------------------------------------------------

RESPONSES = "/v1/responses"


@pytest.mark.parametrize(
    ("body", "status", "param", "message"),
    [
        ({"input": "hi", "tools": [{"type": "telepathy"}]}, 400, "tools", "'telepathy' are not supported"),
        ({"input": "hi", "background": True}, 400, "background", "background responses are not supported"),
        ({"input": "hi", "conversation": "conv_1"}, 400, "conversation", "conversations are not supported"),
        ({"input": "hi", "truncation": "auto"}, 400, "truncation", "disabled"),
        ({"input": "hi", "tool_choice": {"type": "web_search_preview"}}, 400, "tool_choice", "web_search_preview"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"},
                                                 {"type": "input_image", "image_url": "x"}]}]}, 400,
         "input[0].content[1]", "input[0].content[1]: this model takes no images (an input_image part; it is a text"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]}, 400,
         "input.0.message.content", "'input_file' parts cannot be given to this model"),
        ({"input": 5}, 400, "input", "a string or a list of input items"),
        ({"input": [{"type": "computer_call", "id": "x"}]}, 400, "input", "'computer_call' are not supported"),
        ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, 400,
         "input[0].call_id", "no function_call with call_id 'call_x'"),
        ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens", "max_output_tokens"),
        ({"input": "hi", "temperature": 3}, 400, "temperature", "temperature"),
        ({"input": "hi", "frequency_penalty": 1}, 400, "frequency_penalty", "unknown field"),
        ({"input": []}, 400, "input", "input"),
        ({}, 400, "input", "input is required"),
        ({"model": "gpt-5", "input": "hi"}, 404, "model", "gpt-5"),
        ({"input": "hi", "previous_response_id": "resp_nope"}, 404, "previous_response_id", "resp_nope"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
         400, "text.format.schema", ""),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
         400, "text.format", "leave text.format out"),
        ({"input": "hi", "metadata": {str(i): "v" for i in range(17)}}, 400, "metadata", "16"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, param, message):
    response = httpx.post(server.url + RESPONSES, json=body, timeout=120)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and re.search(re.escape(message), error["message"]), error


def test_get_and_delete_of_an_unknown_id_are_404(server):
    for method in ("GET", "DELETE"):
        response = httpx.request(method, server.url + RESPONSES + "/resp_unknown")
        assert response.status_code == 404 and response.json()["error"]["param"] == "response_id"


# -- limits of the chat route ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def guarded_server() -> Iterator[ServerProcess]:
    process = ServerProcess("--api-key", "sesame", "--max-prompt-chars", "300", "--max-request-body-bytes", "4096",
                            "--responses-store-max-entries", "2")
    yield process
    assert process.stop() == 0, process.output()


def test_the_chat_routes_limits_apply(guarded_server):
    url = guarded_server.url + RESPONSES
    assert httpx.post(url, json={"input": "hi"}).status_code == 401
    assert httpx.get(url + "/resp_x").status_code == 401
    key = {"Authorization": "Bearer sesame"}
    too_long = httpx.post(url, json={"input": "hi " * 200, "max_output_tokens": 2}, headers=key)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "messages"
    too_big = httpx.post(url, json={"input": "x" * 5000}, headers=key)
    assert too_big.status_code == 413 and "--max-request-body-bytes" in too_big.json()["error"]["message"]
    # --responses-store-max-entries 2: the third response stored drops the first.
    client = openai.OpenAI(base_url=guarded_server.url + "/v1", api_key="sesame", max_retries=0, timeout=120)
    ids = [client.responses.create(model=MODEL, input=f"Count to {i}.", max_output_tokens=2).id for i in range(3)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]


# -- the output builder on its own ----------------------------------------------------------------

def test_builder_orders_reasoning_text_and_calls_as_written():
    builder = OutputBuilder()
    events = builder.reasoning("Think") + builder.reasoning("ing.") + builder.delta(ContentDelta("Calling."))
    events += builder.tool_call(ToolCallDelta(0, id="call_1", name="f")) + builder.tool_call(ToolCallDelta(0, arguments="{}"))
    events += builder.close("completed")
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
    ]
    assert [(item["type"], item["status"]) for item in builder.items] == [
        ("reasoning", "completed"), ("message", "completed"), ("function_call", "completed")]
    assert builder.items[0]["content"] == [{"type": "reasoning_text", "text": "Thinking."}]
    assert builder.items[2]["arguments"] == "{}" and builder.items[2]["call_id"] == "call_1"
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
