"""A thinking model behind `roseinfer serve --reasoning-parser qwen3`, through the Responses API
(the official `openai` client) and Anthropic's Messages API (the official `anthropic` client):
the thinking comes as a reasoning output item / a thinking block before the answer, whole and
streamed, and is exactly what /v1/chat/completions splits off for the same conversation.

The model is a tiny random Qwen3 with the template of Qwen3's thinking models (the prompt opens
`<think>`); a thinking budget closes the thinking so that an answer follows it."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from live_server import ServerProcess
from support import (
    QWEN3_THINKING_CHAT_TEMPLATE,
    THINKING_MODEL,
    THINKING_SERVER_FLAGS,
    tiny_qwen3_thinking_model,
)

MODEL = THINKING_MODEL
QUESTION = "What is two plus two?"
MAX_TOKENS = 12
BUDGET = 3  # the random model writes no EOS in these 12 tokens (Responses has no ignore_eos)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    path = tmp_path_factory.mktemp("qwen3-thinking")
    tiny_qwen3_thinking_model(path, QWEN3_THINKING_CHAT_TEMPLATE)
    process = ServerProcess("--model", str(path), *THINKING_SERVER_FLAGS)
    yield process
    assert process.stop() == 0, process.output()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected(client) -> tuple[str, str]:
    """(thinking, answer) as the chat route splits them, for the same conversation and settings."""
    message = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=MAX_TOKENS,
        extra_body={"thinking_token_budget": BUDGET}).choices[0].message
    thinking = (message.model_extra or {}).get("reasoning_content")
    assert thinking and message.content  # the budget closed the thinking and an answer followed
    return thinking, message.content


# -- Responses API ------------------------------------------------------------------------------

def responses_args(**fields):
    return {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": MAX_TOKENS,
            "extra_body": {"thinking_token_budget": BUDGET}} | fields


def reasoning_and_answer(response) -> tuple[str, str]:
    assert [item.type for item in response.output] == ["reasoning", "message"]
    reasoning, message = response.output
    assert [part.type for part in reasoning.content] == ["reasoning_text"]
    return reasoning.content[0].text, message.content[0].text


def test_responses_put_the_reasoning_item_before_the_message(client, expected):
    response = client.responses.create(**responses_args())
    assert reasoning_and_answer(response) == expected
    assert response.output_text == expected[1] and response.status == "incomplete"
    # The reasoning tokens are not counted apart (the engine reports no per-token phase).
    assert response.usage.output_tokens_details.reasoning_tokens == 0

    # summary is accepted and changes nothing; the stored response continues with its reasoning.
    again = client.responses.create(**responses_args(reasoning={"summary": "auto"}))
    assert reasoning_and_answer(again) == expected
    follow = client.responses.create(**responses_args(input="And three?", previous_response_id=again.id))
    assert follow.output[0].type == "reasoning"


def test_responses_stream_the_reasoning_then_the_answer(client, expected):
    kinds, reasoning, answer = [], "", ""
    with client.responses.stream(**responses_args()) as stream:
        for event in stream:
            if event.type == "response.reasoning_text.delta":
                kinds.append("reasoning")
                reasoning += event.delta
                assert event.output_index == 0
            elif event.type == "response.output_text.delta":
                kinds.append("answer")
                answer += event.delta
                assert event.output_index == 1
            elif event.type == "response.output_item.added":
                kinds.append(f"added {event.item.type}")
            elif event.type == "response.incomplete":  # cut by max_output_tokens, as the chat reply was
                final = event.response
    assert (reasoning, answer) == expected == reasoning_and_answer(final)
    assert kinds[0] == "added reasoning" and "added message" in kinds
    opened = kinds.index("added message")
    assert set(kinds[1:opened]) == {"reasoning"} and set(kinds[opened + 1:]) == {"answer"}
    assert kinds.count("answer") > 1  # streamed as generated (the thinking's 3 tokens make up one character)


def test_responses_refuse_unsupported_reasoning_settings(server):
    response = httpx.post(server.url + "/v1/responses", json={"input": QUESTION, "reasoning": {"generate_summary": "auto"}})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "reasoning.generate_summary"


# -- Anthropic's Messages API -------------------------------------------------------------------

def messages_args(**fields):
    # The anthropic client has no temperature argument any more: a body field.
    return {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": MAX_TOKENS,
            "extra_body": {"temperature": 0}, "thinking": {"type": "enabled", "budget_tokens": BUDGET}} | fields


def thinking_and_answer(message) -> tuple[str, str]:
    assert [block.type for block in message.content] == ["thinking", "text"]
    return message.content[0].thinking, message.content[1].text


def test_messages_put_a_thinking_block_before_the_answer(claude, expected):
    message = claude.messages.create(**messages_args())
    assert thinking_and_answer(message) == expected
    assert message.stop_reason == "max_tokens"


def test_messages_stream_thinking_deltas_then_text(claude, expected):
    kinds, thinking, answer = [], "", ""
    with claude.messages.stream(**messages_args()) as stream:
        for event in stream:
            if event.type == "content_block_start":
                kinds.append(f"start {event.content_block.type} {event.index}")
            elif event.type == "content_block_delta" and event.delta.type == "thinking_delta":
                kinds.append("thinking")
                thinking += event.delta.thinking
            elif event.type == "content_block_delta" and event.delta.type == "text_delta":
                kinds.append("text")
                answer += event.delta.text
        final = stream.get_final_message()
    assert (thinking, answer) == expected == thinking_and_answer(final)
    opened = kinds.index("start text 1")
    assert kinds[0] == "start thinking 0" and set(kinds[1:opened]) == {"thinking"}
    assert set(kinds[opened + 1:]) == {"text"} and kinds.count("text") > 1


def test_messages_refuse_a_budget_beyond_max_tokens(claude):
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(**messages_args(thinking={"type": "enabled", "budget_tokens": MAX_TOKENS}))
    assert "budget_tokens" in bad.value.body["error"]["message"]


def test_thinking_off_is_the_chat_routes_enable_thinking_false(client, claude):
    """effort "minimal" and thinking disabled are the template's enable_thinking=false (which this
    thinking-only template ignores: the model still thinks, and both fronts split it as chat does)."""
    message = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=MAX_TOKENS,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    thinking = (message.model_extra or {}).get("reasoning_content")
    assert thinking

    response = client.responses.create(**responses_args(reasoning={"effort": "minimal"}, extra_body={}))
    assert response.output[0].type == "reasoning" and response.output[0].content[0].text == thinking
    assert response.output_text == (message.content or "")

    reply = claude.messages.create(**messages_args(thinking={"type": "disabled"}))
    assert reply.content[0].type == "thinking" and reply.content[0].thinking == thinking
    assert "".join(block.text for block in reply.content if block.type == "text") == (message.content or "")
