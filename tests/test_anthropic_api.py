"""Anthropic's Messages API and vLLM's /tokenize and /detokenize, end to end: one real `roseinfer
serve` (with an API key) driven by the official `anthropic` client and httpx, checked against the
same server's OpenAI chat route (the official `openai` client) and against roseinfer's own
tokenizer and chat template in this process."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import openai
import pytest
from live_server import ServerProcess
from support import EXACT_FLAGS

from roseinfer.models.loader import ModelSource

MODEL = "SmolLM2-135M-Instruct"
KEY = "anthropic-test-key"
GREEDY = {"temperature": 0}  # the anthropic client has no temperature argument any more: sent as a body field
SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                     "required": ["city"], "additionalProperties": False},
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = ServerProcess(*EXACT_FLAGS, "--api-key", KEY)
    yield process
    assert process.stop() == 0, process.output()


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    return ModelSource.resolve(None).tokenizer()


def template_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The prompt the chat route feeds for OpenAI-shaped messages: the chat template, then the ids."""
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs),
                            add_special_tokens=False)


def prompt_tokens(usage) -> int:
    """The prompt's tokens: those computed and those read from the prefix cache (Anthropic counts
    them apart)."""
    return usage.input_tokens + usage.cache_read_input_tokens


def openai_tools(*tools: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                              "parameters": t["input_schema"]}} for t in tools]


def raw_events(client: anthropic.Anthropic, **request) -> list:
    """The stream's events as the client parses them (it drops the pings)."""
    return list(client.messages.create(model=MODEL, stream=True, extra_body=GREEDY, **request))


def sse_events(server: ServerProcess, **request) -> list[tuple[str, dict]]:
    """The stream's events as sent: (the `event:` name, the data), pings included."""
    events, name = [], None
    body = {"model": MODEL, "stream": True, **GREEDY, **request}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
    return events


def test_create_answers_as_the_chat_route_with_counted_usage(server, client, tokenizer):
    message = client.messages.create(model=MODEL, max_tokens=24, system=SYSTEM, messages=QUESTION, extra_body=GREEDY,
                                     metadata={"user_id": "u-1"})
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    reference = chat.chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0, messages=[{"role": "system", "content": SYSTEM}, *QUESTION])
    choice = reference.choices[0]
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == choice.message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[choice.finish_reason]
    assert message.stop_sequence is None
    prompt = template_ids(tokenizer, [{"role": "system", "content": SYSTEM}, *QUESTION])
    assert prompt_tokens(message.usage) == len(prompt) == reference.usage.prompt_tokens
    assert message.usage.output_tokens == reference.usage.completion_tokens


def test_stream_sends_anthropics_events_in_order_and_the_same_text(server, client):
    request = {"max_tokens": 20, "system": [{"type": "text", "text": SYSTEM}], "messages": QUESTION}
    whole = client.messages.create(model=MODEL, extra_body=GREEDY, **request)
    sent = sse_events(server, **request)
    assert all(name == data["type"] for name, data in sent)
    names = [name for name, _ in sent]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    # The client reads the same stream (pings dropped) into its typed events.
    events = raw_events(client, **request)
    assert [event.type for event in events] == [name for name in names if name != "ping"]
    start = events[0].message
    assert start.id.startswith("msg_") and start.content == [] and start.stop_reason is None
    assert prompt_tokens(start.usage) == prompt_tokens(whole.usage)
    assert events[1].content_block.type == "text" and events[1].index == 0
    assert all(e.index == 0 and e.delta.type == "text_delta" for e in events[2:-3])
    assert "".join(e.delta.text for e in events[2:-3]) == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    # The client's own stream helper assembles the same message.
    with client.messages.stream(model=MODEL, extra_body=GREEDY, **request) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_count_tokens_is_the_prompt_the_server_feeds(client, tokenizer, server):
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=QUESTION)
    prompt = template_ids(tokenizer, [{"role": "system", "content": SYSTEM}, *QUESTION])
    assert counted.input_tokens == len(prompt)
    with_tools = client.messages.count_tokens(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER])
    assert with_tools.input_tokens == len(template_ids(tokenizer, ASK_WEATHER, openai_tools(WEATHER)))
    # /tokenize gives the same ids for the same chat (vLLM's shape).
    tokenized = httpx.post(server.url + "/tokenize", headers={"x-api-key": KEY}, json={
        "messages": [{"role": "system", "content": SYSTEM}, *QUESTION]}).json()
    assert tokenized["tokens"] == prompt and tokenized["count"] == len(prompt)


def test_tool_use_round_trip(client, tokenizer):
    first = client.messages.create(model=MODEL, max_tokens=40, messages=ASK_WEATHER, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    (call,) = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    # The call goes back as the assistant's turn (the client's own blocks), its result in a user turn.
    conversation = [*ASK_WEATHER, {"role": "assistant", "content": first.content},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                  "content": "18 degrees and sunny"}]}]
    second = client.messages.create(model=MODEL, max_tokens=24, messages=conversation, tools=[WEATHER],
                                    tool_choice={"type": "none"}, extra_body=GREEDY)
    assert [block.type for block in second.content] == ["text"] and second.content[0].text
    assert second.stop_reason in ("end_turn", "max_tokens")
    # What the model was fed: the same conversation in OpenAI's shapes, through the chat template.
    as_openai = [*ASK_WEATHER,
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.input}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    assert prompt_tokens(second.usage) == len(template_ids(tokenizer, as_openai, openai_tools(WEATHER)))
    # A result of several text blocks: their lines, as the chat route joins text parts.
    longer = [*conversation[:-1], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "18 degrees and sunny"},
                                                                    {"type": "text", "text": "with a light breeze"}]}]}]
    as_openai[-1]["content"] = "18 degrees and sunny\nwith a light breeze"
    assert client.messages.count_tokens(model=MODEL, messages=longer, tools=[WEATHER]).input_tokens == len(
        template_ids(tokenizer, as_openai, openai_tools(WEATHER))) > prompt_tokens(second.usage)


def test_tool_use_streams_as_input_json_deltas(client):
    request = {"max_tokens": 40, "messages": ASK_WEATHER, "tools": [WEATHER], "tool_choice": {"type": "any"}}
    whole = client.messages.create(model=MODEL, extra_body=GREEDY, **request)
    events = raw_events(client, **request)
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == [b.type for b in whole.content]
    for start, block in zip(starts, whole.content, strict=True):
        pieces = [e.delta for e in events if e.type == "content_block_delta" and e.index == start.index]
        if block.type == "tool_use":
            assert start.content_block.name == block.name
            assert json.loads("".join(p.partial_json for p in pieces)) == block.input
        else:
            assert "".join(p.text for p in pieces) == block.text
    assert events[-2].delta.stop_reason == whole.stop_reason == "tool_use"
    assert {b.type for b in whole.content} == {"tool_use"}


def test_stop_sequences(client):
    free = client.messages.create(model=MODEL, max_tokens=24, messages=QUESTION, extra_body=GREEDY).content[0].text
    word = free.split()[3]
    stopped = client.messages.create(model=MODEL, max_tokens=24, messages=QUESTION, extra_body=GREEDY,
                                     stop_sequences=["never-generated", word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == free[: free.index(word)]
    events = raw_events(client, max_tokens=24, messages=QUESTION, stop_sequences=[word])
    assert events[-2].delta.stop_reason == "stop_sequence" and events[-2].delta.stop_sequence == word


def test_errors_have_anthropics_shape(server, client):
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=8, messages=QUESTION, extra_body={"top_a": 0.5})
    assert bad.value.status_code == 400
    assert bad.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": (
        "unknown field 'top_a': Anthropic's Messages API does not define it here (see the README for the "
        "accepted fields)")}}
    unsupported = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, json={
        "model": MODEL, "messages": QUESTION, "max_tokens": 8, "container": "container_1"})
    assert unsupported.status_code == 400 and unsupported.json()["error"]["type"] == "invalid_request_error"
    assert "code-execution containers are not supported" in unsupported.json()["error"]["message"]
    missing = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, json={"model": MODEL, "messages": QUESTION})
    assert missing.status_code == 400
    assert missing.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens is required"}}
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="claude-unknown", max_tokens=8, messages=QUESTION)
    assert unknown.value.body["type"] == "error" and unknown.value.body["error"]["type"] == "not_found_error"
    # The key in Anthropic's own header: a wrong one is refused in Anthropic's shape, the right one works.
    wrong = anthropic.Anthropic(base_url=server.url, default_headers={"x-api-key": "wrong"}, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.count_tokens(model=MODEL, messages=QUESTION)
    assert refused.value.status_code == 401
    assert refused.value.body["type"] == "error" and refused.value.body["error"]["type"] == "authentication_error"
    right = anthropic.Anthropic(base_url=server.url, default_headers={"x-api-key": KEY}, max_retries=0)
    assert right.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens > 0
    # The other routes keep OpenAI's error object.
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).json()["error"]["type"] == "authentication_error"


def test_tokenize_and_detokenize(server, tokenizer):
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(server.url + path, headers={"Authorization": f"Bearer {KEY}"}, json=body)

    text = "The quick brown fox jumps over the lazy dog."
    result = post("/tokenize", {"prompt": text, "return_token_strs": True}).json()
    ids = tokenizer.encode(text)
    assert result == {"count": len(ids), "max_model_len": result["max_model_len"], "tokens": ids,
                      "token_strs": [tokenizer.id_to_token(i) for i in ids]}
    assert result["max_model_len"] > 0
    assert post("/tokenize", {"prompt": text}).json()["token_strs"] is None
    assert post("/detokenize", {"tokens": ids}).json() == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
    chat = template_ids(tokenizer, QUESTION)
    assert post("/detokenize", {"tokens": chat}).json()["prompt"] == tokenizer.apply_chat_template(QUESTION)
    bad = post("/detokenize", {"tokens": [1, len(tokenizer) + 5]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert str(len(tokenizer) + 5) in bad.json()["error"]["message"]
    negative = post("/detokenize", {"tokens": [-1]})
    assert negative.status_code == 400 and negative.json()["error"]["param"] == "tokens.0"
    neither = post("/tokenize", {"return_token_strs": True})
    assert neither.status_code == 400 and "prompt" in neither.json()["error"]["message"]
