"""gpt-oss behind `roseinfer serve`, with no flag: prompts are rendered by openai-harmony and the
output is read by the harmony parsers, through the official `openai` and `anthropic` clients.

The model is a tiny random gpt-oss (transformers' own class) with gpt-oss's vocabulary, o200k_harmony
(tests/harmony_vocab.py builds it offline). The prompt's token ids are compared with
openai-harmony's rendering of the same conversation. A random model writes no harmony of its own,
so the output side is teacher-forced: a grammar (`structured_outputs`, ours on all three routes) makes the
real engine generate a harmony completion token by token, and the response must carry its analysis
as reasoning and its messages to `functions.NAME` as tool calls, whole and streamed."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import openai
import pytest
import torch
from harmony_vocab import ensure_o200k, write_harmony_tokenizer
from live_server import ServerProcess
from support import EXACT_FLAGS

ensure_o200k()  # before openai-harmony first loads its encoding, here and in the server it starts

import openai_harmony as harmony  # noqa: E402

MODEL = "tiny-gpt-oss"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
QUESTION = "Weather in Paris?"


@pytest.fixture(scope="module")
def encoding():
    return harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    import transformers
    from test_gpt_oss import tiny_gpt_oss_config

    path = tmp_path_factory.mktemp("gpt_oss_harmony")
    vocab = write_harmony_tokenizer(path)
    config = tiny_gpt_oss_config(vocab)
    config.max_position_embeddings = 1024
    config.eos_token_id = 200002  # <|return|>, as gpt-oss's own config
    torch.manual_seed(0)
    transformers.GptOssForCausalLM(config).save_pretrained(path)
    process = ServerProcess("--model", str(path), "--served-model-name", MODEL, "--max-model-len", "1024",
                            "--num-kv-blocks", "96", *EXACT_FLAGS)
    yield process
    assert process.stop() == 0, process.output()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _m(role, content):
    return harmony.Message.from_role_and_content(role, content)


def _assistant(text: str, channel: str):
    return _m(harmony.Role.ASSISTANT, text).with_channel(channel)


def _call(name: str, arguments: str):
    return (_assistant(arguments, "commentary").with_recipient(f"functions.{name}")
            .with_content_type("<|constrain|>json"))


def _developer(instructions: str | None = None):
    content = harmony.DeveloperContent.new()
    if instructions:
        content = content.with_instructions(instructions)
    return _m(harmony.Role.DEVELOPER, content.with_function_tools([harmony.ToolDescription.new(
        "get_weather", "Weather of a city", parameters=TOOLS[0]["function"]["parameters"])]))


def expected_prompt(encoding, *messages, effort=None) -> list[int]:
    system = harmony.SystemContent.new()
    if effort is not None:
        system = system.with_reasoning_effort(effort)
    conversation = harmony.Conversation.from_messages([_m(harmony.Role.SYSTEM, system), *messages])
    return list(encoding.render_conversation_for_completion(conversation, harmony.Role.ASSISTANT))


def forcing_grammar(encoding, *messages) -> dict:
    """A Lark grammar whose one sentence is the completion the messages render to (after the
    prompt's `<|start|>assistant`): special tokens by id, text as literal strings."""
    tokens = []
    for message in messages:
        tokens += encoding.render(message)
    tokens = tokens[2:]  # <|start|>assistant, which the prompt ends with
    pieces, text = [], []
    for token in tokens:
        if encoding.is_special_token(token):
            if text:
                pieces.append(json.dumps(encoding.decode(text)))
                text = []
            pieces.append(f"<[{token}]>")
        else:
            text.append(token)
    assert not text
    return {"structured_outputs": {"grammar": "start: " + " ".join(pieces)}}


# -- the prompt ------------------------------------------------------------------------------------

def test_prompt_is_openai_harmonys_rendering(server, encoding):
    """A whole agent turn (instructions, tools, the earlier analysis, a tool call and its result)
    renders to the token ids openai-harmony gives the same conversation, reasoning_effort included."""
    import httpx

    messages = [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "reasoning_content": "Call the tool.", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    tool_result = (harmony.Message.from_author_and_content(
        harmony.Author.new(harmony.Role.TOOL, "functions.get_weather"), '{"temp": 21}')
        .with_channel("commentary").with_recipient("assistant"))
    history = [_developer("Answer in French."), _m(harmony.Role.USER, QUESTION),
               _assistant("Call the tool.", "analysis"), _call("get_weather", '{"city": "Paris"}'), tool_result]
    for effort, level in ((None, None), ("high", harmony.ReasoningEffort.HIGH), ("minimal", harmony.ReasoningEffort.LOW)):
        body = {"model": MODEL, "messages": messages, "tools": TOOLS} | ({"reasoning_effort": effort} if effort else {})
        tokens = httpx.post(server.url + "/tokenize", json=body, timeout=60).json()["tokens"]
        assert tokens == expected_prompt(encoding, *history, effort=level), effort


def test_every_api_feeds_the_same_harmony_prompt(client, claude, encoding):
    """Chat, Responses and Messages count the prompt openai-harmony renders, the effort each
    API names included (a one-token level: the count is the rendering's length)."""
    user = _m(harmony.Role.USER, QUESTION)
    plain = expected_prompt(encoding, user)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=1, temperature=0, reasoning_effort="low")
    assert chat.usage.prompt_tokens == len(expected_prompt(encoding, user, effort=harmony.ReasoningEffort.LOW))
    response = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=1, temperature=0,
                                       reasoning={"effort": "high"})
    assert response.usage.input_tokens == len(expected_prompt(encoding, user, effort=harmony.ReasoningEffort.HIGH))
    counted = claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": QUESTION}])
    assert counted.input_tokens == len(plain)
    tools = claude.messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], system="Answer in French.",
        tools=[{"name": "get_weather", "description": "Weather of a city",
                "input_schema": TOOLS[0]["function"]["parameters"]}])
    assert tools.input_tokens == len(expected_prompt(encoding, _developer("Answer in French."), user))


def test_effort_outside_harmonys_levels_and_template_kwargs_are_refused(client):
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"foo": 1}})


# -- the output, teacher-forced --------------------------------------------------------------------

def test_chat_reasoning_and_tool_call(client, encoding):
    grammar = forcing_grammar(encoding, _assistant("Need the weather.", "analysis"),
                              _call("get_weather", '{"city": "Paris"}'))
    args = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "tools": TOOLS,
            "temperature": 0, "max_tokens": 200, "extra_body": grammar}
    choice = client.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == "Need the weather."
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    # Streamed: the same reasoning and call, finish_reason tool_calls.
    reasoning, names, arguments, finish = "", [], "", None
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            for piece in c.delta.tool_calls or []:
                names += [piece.function.name] if piece.function.name else []
                arguments += piece.function.arguments or ""
            finish = c.finish_reason or finish
    assert (reasoning, names, json.loads(arguments), finish) == (
        "Need the weather.", ["get_weather"], {"city": "Paris"}, "tool_calls")


def test_chat_reasoning_and_final_answer(client, encoding):
    grammar = forcing_grammar(encoding, _assistant("The user greets.", "analysis"),
                              _assistant("Hello! How can I help?", "final"))
    args = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 200,
            "extra_body": grammar}
    choice = client.chat.completions.create(**args).choices[0]
    assert (choice.finish_reason, choice.message.model_extra["reasoning_content"], choice.message.content) == (
        "stop", "The user greets.", "Hello! How can I help?")
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
    assert (reasoning, content) == ("The user greets.", "Hello! How can I help?")


def test_responses_reasoning_item_and_function_call(client, encoding):
    grammar = forcing_grammar(encoding, _assistant("Need the weather.", "analysis"),
                              _call("get_weather", '{"city": "Paris"}'))
    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
              "parameters": TOOLS[0]["function"]["parameters"]}]
    args = {"model": MODEL, "input": QUESTION, "tools": tools, "temperature": 0, "max_output_tokens": 200,
            "extra_body": grammar}
    response = client.responses.create(**args)
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    reasoning, call = response.output
    assert reasoning.content[0].text == "Need the weather."
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    with client.responses.stream(**args) as stream:
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    assert final.output[0].content[0].text == "Need the weather." and final.output[1].name == "get_weather"
    # The answer after the analysis is the message.
    answer = client.responses.create(model=MODEL, input="Hi", temperature=0, max_output_tokens=200, extra_body=(
        forcing_grammar(encoding, _assistant("The user greets.", "analysis"), _assistant("Hello!", "final"))))
    assert [item.type for item in answer.output] == ["reasoning", "message"]
    assert answer.output_text == "Hello!" and answer.status == "completed"


def test_anthropic_thinking_and_tool_use(claude, encoding):
    grammar = forcing_grammar(encoding, _assistant("Need the weather.", "analysis"),
                              _call("get_weather", '{"city": "Paris"}'))
    args = {"model": MODEL, "max_tokens": 200, "extra_body": grammar,
            "messages": [{"role": "user", "content": QUESTION}],
            "tools": [{"name": "get_weather", "description": "Weather of a city",
                       "input_schema": TOOLS[0]["function"]["parameters"]}]}
    message = claude.messages.create(**args)
    assert [block.type for block in message.content] == ["thinking", "tool_use"]
    assert message.content[0].thinking == "Need the weather."
    assert (message.content[1].name, message.content[1].input) == ("get_weather", {"city": "Paris"})
    assert message.stop_reason == "tool_use"
    with claude.messages.stream(**args) as stream:
        streamed = stream.get_final_message()
    assert [block.type for block in streamed.content] == ["thinking", "tool_use"]
    assert streamed.content[0].thinking == "Need the weather." and streamed.content[1].input == {"city": "Paris"}
    answer = claude.messages.create(model=MODEL, max_tokens=200, messages=[
        {"role": "user", "content": "Hi"}], extra_body=forcing_grammar(
        encoding, _assistant("The user greets.", "analysis"), _assistant("Hello!", "final")))
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in answer.content] == [
        ("thinking", "The user greets."), ("text", "Hello!")]
    assert answer.stop_reason == "end_turn"
