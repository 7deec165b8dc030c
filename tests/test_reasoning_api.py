"""A thinking model behind `roseinfer serve --reasoning-parser qwen3`, end to end through the
official `openai` client: the thinking in `reasoning_content` (and `reasoning`), whole and in
stream deltas, the answer alone in `content`; `thinking_token_budget` closes the thinking after N
tokens; structured outputs and required tool calls constrain the answer while the thinking stays
the model's own.

The model is a tiny random Qwen3 with the template of Qwen3's thinking models (the prompt opens
`<think>`). The reference for what the engine generated is the same prompt on /v1/completions,
rendered by transformers, whose raw text holds the `</think>` the budget forced."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
import transformers
from live_server import ServerProcess
from pydantic import BaseModel, Field
from support import (
    QWEN3_THINKING_CHAT_TEMPLATE,
    THINKING_MODEL,
    THINKING_SERVER_FLAGS,
    tiny_qwen3_thinking_model,
)

MODEL = THINKING_MODEL
QUESTION = [{"role": "user", "content": "What is two plus two?"}]
GREEDY = {"temperature": 0, "max_tokens": 12}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False},
}}


class Answer(BaseModel):
    answer: int = Field(ge=0, le=99)
    sure: bool


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-thinking")
    tiny_qwen3_thinking_model(path, QWEN3_THINKING_CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(model_dir) -> Iterator[ServerProcess]:
    process = ServerProcess("--model", str(model_dir), *THINKING_SERVER_FLAGS)
    yield process
    assert process.stop() == 0, process.output()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def no_whitespace(model_dir) -> dict[str, float]:
    """A logit_bias against every whitespace-only token: JSON allows whitespace anywhere, and a
    random model would write it forever. (It biases the thinking too: compare like with like.)"""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    blank = [i for i in range(len(tokenizer)) if (text := tokenizer.decode([i])) and not text.strip()]
    assert blank
    return {str(i): -100 for i in blank}


def chat(client: openai.OpenAI, **fields):
    extra = fields.pop("extra_body", {})
    return client.chat.completions.create(model=MODEL, messages=QUESTION, **(GREEDY | fields),
                                          extra_body={"ignore_eos": True} | extra)


def reasoning_of(message) -> str | None:
    """The thinking, which must come under both of vLLM's names."""
    extra = message.model_extra or {}
    assert extra.get("reasoning_content") == extra.get("reasoning")
    return extra.get("reasoning_content")


def raw_completion(client: openai.OpenAI, model_dir, budget: int, max_tokens: int = 12) -> str:
    """The engine's whole output for the same prompt, rendered by transformers, unsplit."""
    prompt = transformers.AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        QUESTION, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<think>\n")
    response = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=max_tokens,
                                         extra_body={"ignore_eos": True, "thinking_token_budget": budget})
    return response.choices[0].text


def test_the_thinking_is_reasoning_content_and_the_answer_content(client, model_dir):
    raw = raw_completion(client, model_dir, budget=5)
    thinking, tag, answer = raw.partition("</think>")
    assert tag and answer  # the budget closed the thinking and the model went on answering
    message = chat(client, extra_body={"thinking_token_budget": 5}).choices[0].message
    assert reasoning_of(message) == thinking
    assert message.content == answer
    assert "</think>" not in message.content and "<think>" not in message.content

    hidden = chat(client, extra_body={"thinking_token_budget": 5, "include_reasoning": False}).choices[0].message
    assert reasoning_of(hidden) is None and hidden.content == answer


def test_stream_deltas_carry_the_thinking_then_the_answer(client):
    whole = chat(client, extra_body={"thinking_token_budget": 5}).choices[0].message
    kinds, reasoning, content = [], "", ""
    stream = chat(client, stream=True, extra_body={"thinking_token_budget": 5})
    for chunk in stream:
        for choice in chunk.choices:
            piece = reasoning_of(choice.delta)
            if piece:
                kinds.append("reasoning")
                reasoning += piece
                assert not choice.delta.content  # a delta is one or the other
            if choice.delta.content:
                kinds.append("content")
                content += choice.delta.content
    assert (reasoning, content) == (reasoning_of(whole), whole.content)
    assert kinds == sorted(kinds, key=["reasoning", "content"].index)  # all thinking, then the answer
    assert kinds.count("reasoning") > 1 and kinds.count("content") > 1  # streamed as generated
    assert "</think>" not in content


def test_the_budget_closes_the_thinking_after_n_tokens(client):
    for budget in (0, 4):
        response = chat(client, logprobs=True, extra_body={"thinking_token_budget": budget})
        tokens = [entry.token for entry in response.choices[0].logprobs.content]
        assert len(tokens) == response.usage.completion_tokens == GREEDY["max_tokens"]
        assert tokens[budget] == "</think>" and "</think>" not in tokens[:budget], tokens
        message = response.choices[0].message
        assert reasoning_of(message) == "".join(tokens[:budget])
    # Without a budget the random model thinks to the end: no answer at all.
    message = chat(client).choices[0].message
    assert message.content is None and len(reasoning_of(message)) > 0


def test_a_schema_constrains_the_answer_after_the_unconstrained_thinking(client, no_whitespace):
    free = chat(client, logit_bias=no_whitespace, extra_body={"thinking_token_budget": 4}).choices[0].message
    response = chat(client, max_tokens=64, logit_bias=no_whitespace, extra_body={"thinking_token_budget": 4},
                    response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "stop"
    assert reasoning_of(message) == reasoning_of(free)  # the thinking, as the model thinks it
    jsonschema.validate(json.loads(message.content), SCHEMA)

    parsed = client.chat.completions.parse(model=MODEL, messages=QUESTION, temperature=0, max_tokens=64,
                                           logit_bias=no_whitespace, response_format=Answer,
                                           extra_body={"thinking_token_budget": 4})
    assert isinstance(parsed.choices[0].message.parsed, Answer)
    assert reasoning_of(parsed.choices[0].message) == reasoning_of(free)


def test_required_tool_calls_come_after_the_thinking(client, no_whitespace):
    same = {"max_tokens": 96, "tools": [WEATHER], "parallel_tool_calls": False, "logit_bias": no_whitespace,
            "extra_body": {"thinking_token_budget": 3}}
    free = chat(client, tool_choice="none", **same).choices[0].message  # the same prompt, unconstrained
    choice = chat(client, tool_choice="required", **same).choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert reasoning_of(choice.message) == reasoning_of(free)
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_a_negative_budget_is_a_400_naming_it(server):
    response = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": QUESTION, "thinking_token_budget": -1})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "thinking_token_budget"
