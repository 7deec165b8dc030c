"""What agent CLIs send, against one real `roseinfer serve` on the default model with defaults (and a
key), through the official SDKs: the request shapes Claude Code 2.1 (/v1/messages), Codex 0.171
(/v1/responses) and opencode / Qwen Code (chat completions with tools) send on every turn, their
model and token-count probes, the output cap of a request without max_tokens, and the log line
that says once per client what the server ignored.

The default model's chat template has no tool-call format: tool_choice "auto" (the agents'
default) answers in text, and a named tool choice still calls the tool under a grammar."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from live_server import ServerProcess
from support import EXACT_FLAGS

MODEL = "SmolLM2-135M-Instruct"
KEY = "agents-test-key"
DEFAULT_CAP = 12  # --max-tokens-default: what a request without max_tokens may generate
CLAUDE_AGENT = "claude-cli/2.1.332 (external, cli)"

READ = {"name": "Read", "description": "Read a file.", "input_schema": {
    "type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}}
EDIT = {"name": "Edit", "description": "Replace a string in a file.", "input_schema": {
    "type": "object", "properties": {"file_path": {"type": "string"}, "old_string": {"type": "string"},
                                     "new_string": {"type": "string"}}, "required": ["file_path"]}}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = ServerProcess(*EXACT_FLAGS, "--api-key", KEY, "--max-tokens-default", str(DEFAULT_CAP))
    yield process
    assert process.stop() == 0, process.output()


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120,
                               default_headers={"user-agent": CLAUDE_AGENT})


@pytest.fixture(scope="module")
def codex(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120,
                         default_headers={"user-agent": "codex_exec/0.171.0"})


def claude_code_turn(messages: list[dict]) -> dict:
    """A request as Claude Code 2.1 sends each turn (its fields, not its 19k-token prompt)."""
    return {
        "model": MODEL, "max_tokens": 32000, "messages": messages, "tools": [
            READ, {**EDIT, "cache_control": {"type": "ephemeral", "ttl": "1h"}},
            # Claude Code 2.1.332's tool search: refused, it resends every tool up front (3 requests lost).
            {"name": "DeferredToolPlaceholder", "description": "Deferred.", "defer_loading": True,
             "input_schema": {"type": "object", "properties": {}}}],
        "system": [{"type": "text", "text": "You are Claude Code."},
                   {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s"})},
        "thinking": {"type": "adaptive", "display": "summarized"},
        "extra_body": {"temperature": 0, "output_config": {"effort": "medium"}, "context_management": {
            "edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100000}}]}},
    }


def test_claude_code_turns_stream_without_an_api_error(server, claude):
    first = [{"role": "user", "content": [{"type": "text", "text": "Read notes.txt", "cache_control": {"type": "ephemeral"}}]},
             {"role": "system", "content": "The user's cwd is /tmp."}]
    with claude.messages.stream(**claude_code_turn(first)) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    assert "error" not in kinds and kinds[-1] == "message_stop"
    assert message.stop_reason in ("end_turn", "max_tokens") and message.content[0].type == "text"
    # 32000 does not fit this model's context: cut to what does, not a 400.
    assert 0 < message.usage.output_tokens <= 32000
    # The next turn echoes the assistant's blocks as the SDK dumps them (a tool_use with caller:
    # null, a text block with citations: null) and the tool's result.
    # A tool search of Claude Code's own finds a deferred tool: its result is a tool_reference.
    search = {"type": "tool_use", "id": "toolu_00", "name": "ToolSearch", "input": {"query": "edit"}}
    found = {"type": "tool_result", "tool_use_id": "toolu_00", "content": [{"type": "tool_reference", "tool_name": "Edit"}]}
    call = {"type": "tool_use", "id": "toolu_01", "name": "Read", "input": {"file_path": "notes.txt"}, "caller": None}
    second = [*first, {"role": "assistant", "content": [search]}, {"role": "user", "content": [found]},
              {"role": "assistant", "content": [{**message.content[0].model_dump(), "citations": None}, call]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "hello"},
                                           {"type": "text", "text": "Now fix it."}]},
              {"role": "user", "content": "Consecutive user turn."}]
    reply = claude.messages.create(**claude_code_turn(second))
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.content[0].text
    # count_tokens (Claude Code's context check) counts the prompt that was fed.
    fields = claude_code_turn(second)
    counted = claude.messages.count_tokens(model=MODEL, messages=second, tools=fields["tools"], system=fields["system"],
                                           thinking=fields["thinking"],
                                           extra_body={"context_management": fields["extra_body"]["context_management"]})
    assert counted.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    # Said once for this client, however many requests carry it.
    log = server.output()
    assert log.count(f"{CLAUDE_AGENT} sends context_management") == 1, log
    assert log.count(f"{CLAUDE_AGENT} sends thinking") == 1
    assert log.count(f"{CLAUDE_AGENT} sends tools.defer_loading") == 1


def test_refusals_name_what_cannot_be_honoured(server, claude):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    for content, says in (
            ([{"type": "tool_result", "tool_use_id": "toolu_01", "content": [image]}], "'image' content blocks cannot"),
            ([image], "messages[0].content[0]: this model takes no images (an image block; it is a text model)")):
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": content}])
        assert says in refused.value.body["error"]["message"]
    programmatic = {"type": "tool_use", "id": "toolu_01", "name": "Read", "input": {},
                    "caller": {"type": "code_execution_20250825", "tool_id": "srvtoolu_1"}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=MODEL, max_tokens=4, tools=[READ], messages=[
            {"role": "user", "content": "x"}, {"role": "assistant", "content": [programmatic]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "1"}]}])
    assert "programmatic tool calling" in refused.value.body["error"]["message"]


def test_model_probes(server, claude, codex):
    card = claude.models.retrieve(MODEL)  # Claude Code reads the context and output limits here
    tokenize = httpx.post(server.url + "/tokenize", json={"prompt": "x"}, headers={"x-api-key": KEY}).json()
    assert card.id == MODEL and card.max_input_tokens == tokenize["max_model_len"] and card.max_tokens == DEFAULT_CAP
    assert [model.id for model in claude.models.list()] == [MODEL] == [model.id for model in codex.models.list()]
    assert codex.models.retrieve(MODEL).id == MODEL
    with pytest.raises(anthropic.NotFoundError):
        claude.models.retrieve("claude-opus-9")


def codex_turn(items: list, **fields) -> dict:
    """A request as Codex 0.171 sends each turn (streamed, no max_output_tokens)."""
    shell = {"type": "function", "name": "shell", "description": "Run a command.", "strict": False,
             "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                            "required": ["command"]}}
    files = {"type": "namespace", "name": "mcp__files", "description": "Tools in the mcp__files namespace.", "tools": [
        {"type": "function", "name": "read_file", "description": "Read a file.", "strict": False,
         "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"],
                        "additionalProperties": False}}]}
    hosted = {"type": "web_search", "external_web_access": False}  # OpenAI runs it: left out here
    return {"model": MODEL, "instructions": "You are Codex.", "input": items, "tools": [shell, files, hosted],
            "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
            "store": False, "stream": True, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "thread-1",
            "text": {"verbosity": "low"}, "extra_body": {"client_metadata": {"x-codex-turn": "1"}, "temperature": 0}} | fields


def completed(events: list) -> object:
    kinds = [event.type for event in events]
    assert "response.failed" not in kinds and "error" not in kinds, kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    return events[-1].response


def test_codex_turns_stream_without_an_api_error(server, codex):
    question = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: none."}]},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Show notes.txt"}]}]
    first = completed(list(codex.responses.create(**codex_turn(question))))
    assert first.output[0].type == "message"  # no tool-call format in this template: text
    assert 0 < first.usage.output_tokens <= DEFAULT_CAP  # no max_output_tokens: the server's default cap
    # A named function in the namespace: its call names the namespace, and goes back as Codex echoes it.
    named = completed(list(codex.responses.create(**codex_turn(question, tool_choice={"type": "function",
                                                                                        "name": "read_file"}))))
    (call,) = [item for item in named.output if item.type == "function_call"]
    assert call.name == "read_file" and (call.model_extra or {}).get("namespace", getattr(call, "namespace", None)) \
        == "mcp__files"
    echoed = [*question, {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA"},
              {"type": "function_call", "call_id": call.call_id, "name": "read_file", "namespace": "mcp__files",
               "arguments": '{"path": "notes.txt"}'},
              {"type": "function_call_output", "call_id": call.call_id, "output": "hello"}]
    completed(list(codex.responses.create(**codex_turn(echoed))))
    log = server.output()
    assert log.count("codex_exec/0.171.0 sends client_metadata") == 1 and "sends include" in log
    assert "codex_exec/0.171.0 sends tools, which this server accepts and ignores: left out, the model cannot be " \
           "given them here: web_search tool" in log


def test_chat_agents_tools_auto_answer_in_text(codex):
    """opencode and Qwen Code: tools on every request, tool_choice unset, no max_tokens."""
    tools = [{"type": "function", "function": {"name": "read", "parameters": READ["input_schema"]}}]
    messages = [{"role": "system", "content": "You are opencode."}, {"role": "user", "content": "Read notes.txt"},
                {"role": "system", "content": "Reminder: be brief."}]
    chunks = list(codex.chat.completions.create(model=MODEL, messages=messages, tools=tools, stream=True,
                                                temperature=0, stream_options={"include_usage": True},
                                                reasoning_effort="low"))  # no thinking here: ignored
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage.completion_tokens <= DEFAULT_CAP
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] in (["length"], ["stop"])


def test_caps_that_do_not_fit(server, claude, codex):
    """Messages and Responses cut a cap beyond the context to fit; chat completions say by how much."""
    limit = httpx.get(server.url + "/v1/models/" + MODEL, headers={"x-api-key": KEY}).json()["max_input_tokens"]
    message = claude.messages.create(model=MODEL, max_tokens=limit * 4, messages=[{"role": "user", "content": "Hi"}],
                                     extra_body={"temperature": 0, "stop_sequences": ["."]})
    assert message.stop_reason in ("end_turn", "stop_sequence", "max_tokens")
    with pytest.raises(openai.BadRequestError) as refused:
        codex.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=limit * 4)
    assert "more than fit" in refused.value.body["message"]


def test_effort_is_a_thinking_budget_when_the_model_thinks():
    """Adaptive thinking with output_config.effort (Messages) and reasoning.effort (Responses) become
    the chat request's thinking fields with a reasoning parser, nothing without one."""
    from roseinfer.server.anthropic_protocol import MessagesRequest
    from roseinfer.server.anthropic_serving import chat_request
    from roseinfer.server.effort import EFFORT_BUDGETS
    from roseinfer.server.responses_api import _chat_body
    from roseinfer.server.responses_protocol import ResponsesRequest

    def messages(effort: str, thinking: str = "adaptive") -> MessagesRequest:
        return MessagesRequest.model_validate({"model": MODEL, "max_tokens": 4096, "messages": [
            {"role": "user", "content": "Hi"}], "thinking": {"type": thinking}, "output_config": {"effort": effort}})

    assert chat_request(messages("low"), reasoning=True).thinking_token_budget == EFFORT_BUDGETS["low"] == 512
    assert chat_request(messages("high"), reasoning=True).thinking_token_budget is None
    assert chat_request(messages("low"), reasoning=False).thinking_token_budget is None
    assert chat_request(messages("low", "disabled"), reasoning=True).chat_template_kwargs == {"enable_thinking": False}
    assert messages("low").ignored_fields(reasoning=False) == {
        "thinking": "the model does not think (no --reasoning-parser)",
        "output_config.effort": "the model does not think (no --reasoning-parser)"}
    assert messages("low").ignored_fields(reasoning=True) == {}

    def responses(effort: str) -> ResponsesRequest:
        return ResponsesRequest.model_validate({"input": "Hi", "reasoning": {"effort": effort}})

    body = [{"role": "user", "content": "Hi"}]
    assert _chat_body(responses("medium"), body, reasoning=True).thinking_token_budget == EFFORT_BUDGETS["medium"]
    assert _chat_body(responses("minimal"), body, reasoning=True).chat_template_kwargs == {"enable_thinking": False}
    assert _chat_body(responses("medium"), body, reasoning=False).thinking_token_budget is None


def test_an_agents_next_turn_reads_its_prefix_from_the_cache(server, claude, codex):
    """The second turn resends the first with a new tail: its prefix comes from the prefix cache,
    and each API says how much (Anthropic: cache_read_input_tokens beside input_tokens; OpenAI:
    cached_tokens), also for the same conversation sent through another API."""
    system = f"Session {uuid.uuid4()}. You are a coding agent. " + "Follow the rules. " * 40
    first = [{"role": "user", "content": "Read notes.txt"}]
    one = claude.messages.create(model=MODEL, max_tokens=4, system=system, messages=first, extra_body={"temperature": 0})
    assert one.usage.cache_read_input_tokens == 0
    second = [*first, {"role": "assistant", "content": one.content[0].text or "."},
              {"role": "user", "content": "Now edit it."}]
    two = claude.messages.create(model=MODEL, max_tokens=4, system=system, messages=second, extra_body={"temperature": 0})
    # The first turn's prompt and answer (its KV too is cached), all but the last, partial block.
    shared = one.usage.input_tokens
    assert shared - 16 < two.usage.cache_read_input_tokens <= shared + one.usage.output_tokens
    assert two.usage.input_tokens + two.usage.cache_read_input_tokens == claude.messages.count_tokens(
        model=MODEL, system=system, messages=second).input_tokens
    # The same conversation through the chat and Responses routes renders the same text: a hit too.
    chat = codex.chat.completions.create(model=MODEL, max_tokens=1, messages=[{"role": "system", "content": system},
                                                                              *second])
    assert chat.usage.prompt_tokens_details.cached_tokens >= two.usage.cache_read_input_tokens
    response = codex.responses.create(model=MODEL, max_output_tokens=1, instructions=system, input=second)
    assert response.usage.input_tokens_details.cached_tokens >= two.usage.cache_read_input_tokens
