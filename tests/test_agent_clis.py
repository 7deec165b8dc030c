"""The agent CLIs themselves against a live `roseinfer serve`: Claude Code (/v1/messages), Codex
(/v1/responses), opencode and Qwen Code (chat completions), each the pinned npm build (see
agent_clis.py) in its non-interactive mode, with a throwaway HOME, telemetry and updates off, and
pointed at the server through a recording proxy (recording_proxy.py).

Each agent asks a question, then continues the same session with a second one (its conversation
resent with the first answer in it); then, on a model that calls tools, edits a file through its
own shell tool. Checked: the CLI exits 0 with no error in its output; every request it made was
answered 200; every model response was streamed to its end; the answer it printed is the text the
server streamed; the second turn sent the first answer back as the assistant's and read its prefix
from the prefix cache; the tool call the server streamed is the model's, the CLI ran it (the file
changed) and sent its result back, and the model's answer to that ended the task.

The model is scripted so that its answers are known beforehand and quick to reach: a one-layer
Llama with the default model's tokenizer (the agents' 4-20k-token prompts tokenize as on the default
model, and are processed in seconds), built by `scripted_agent_model`: after the generation prompt
it writes ANSWER and ends, whatever the prompt and the temperature; the tool-calling one first
writes a tool call, and ANSWER once a tool's result is in the prompt. transformers' own generation
on it is the reference for both.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from agent_clis import CLAUDE, CODEX, OPENCODE, QWEN, AgentCli, install, node_major, unsupported
from hf_to_gguf import write_default_tokenizer
from live_server import ServerProcess
from recording_proxy import Exchange, RecordingProxy
from support import QWEN3_CHAT_TEMPLATE

MODEL = "tiny-agent"
KEY = "agent-clis-key"
# The generation prompt of the default model's template ends "<|im_start|>assistant\n": "\n"
# starts the answer. Each token is one token of the tokenizer, none twice.
CHAIN = ["\n", "Hello", " from", " the", " tiny", " model", "."]
ANSWER = "".join(CHAIN[1:])
FIRST, SECOND = "What is 2+2?", "And 3+3?"
RUN_TIMEOUT = 300  # seconds for one CLI run


MARKER = "<tool_response>"  # how the Qwen3 template opens a tool's result


def scripted_agent_model(path: Path, tool_call: str | None = None) -> None:
    """A tiny Llama that writes ANSWER then EOS; with `tool_call` (the Hermes-format text of a call,
    which becomes one token of its tokenizer) and Qwen3's chat template (whose tool-call format
    the server finds), it writes that call then EOS until a tool's result is in the prompt.

    How: the chain tokens' embeddings are orthogonal and scaled to dominate the residual stream,
    and the output head maps each chain token's direction to the next token's logit (the next
    token depends on the last one only). The one attention head (rotary angles ~0 under a huge
    rope_theta) lets the generation prompt's last token ("\n") look for MARKER: found, it adds a
    direction that makes ANSWER's first token win over the tool call."""
    import transformers
    from tokenizers import AddedToken, Tokenizer

    write_default_tokenizer(path)
    if tool_call is not None:
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in (MARKER, tool_call)])
        tokenizer.save(str(path / "tokenizer.json"))
        config = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": QWEN3_CHAT_TEMPLATE}))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = [tokenizer.encode(piece, add_special_tokens=False) for piece in
           [*CHAIN, *([MARKER, tool_call] if tool_call else [])]]
    assert all(len(piece) == 1 for piece in ids) and len({i for (i,) in ids}) == len(ids), ids
    newline, *answer = [i for (i,) in ids[:len(CHAIN)]]
    marker, call = [i for (i,) in ids[len(CHAIN):]] or (None, None)
    eos = tokenizer.eos_token_id
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=65536, rope_theta=1e30,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=eos)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    layer = model.model.layers[0]
    embed, head, attention = model.model.embed_tokens.weight, model.lm_head.weight, layer.self_attn
    with torch.no_grad():
        for weight in (head, layer.mlp.down_proj.weight, attention.q_proj.weight, attention.k_proj.weight,
                       attention.v_proj.weight, attention.o_proj.weight):
            weight.zero_()
        # Orthonormal directions (Gram-Schmidt): "\n", the marker, the "tool result seen" direction, the chain.
        chain = [newline, *([call] if call is not None else []), *answer]
        basis: list[torch.Tensor] = []
        for token in [marker, None, *chain] if call is not None else chain:
            vector = embed[token].clone() if token is not None else torch.randn(64)
            for done in basis:
                vector -= (vector @ done) * done
            basis.append(vector / vector.norm())
            if token is not None:
                embed[token] = basis[-1] * embed[token].norm() * (1 if token == marker else 20)
        unit = {token: basis[i] for i, token in enumerate([marker, None, *chain] if call is not None else chain)}
        for token, successor in zip(answer, [*answer[1:], eos], strict=True):
            head[successor] += 4 * unit[token]
        if call is None:
            head[answer[0]] += 4 * unit[newline]
        else:
            head[call] += 4 * unit[newline]
            head[eos] += 4 * unit[call]
            # "\n" attends to the marker (a score of ~40 over ~0 elsewhere); its value, written
            # along the seen direction, outweighs the tool call's logit with ANSWER's.
            attention.q_proj.weight[7] = 1.6 * unit[newline]
            attention.k_proj.weight[7] = 1.6 * unit[marker]
            attention.v_proj.weight[7] = unit[marker]
            attention.o_proj.weight[:, 7] = unit[None] * embed[newline].norm() / 8
            head[answer[0]] += 4 * (0.5 * unit[newline] + unit[None])
    model.save_pretrained(path)
    # The reference: transformers' generation writes the call, then after its result ANSWER.
    question = [{"role": "user", "content": FIRST}]
    after_tool = [*question, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "shell", "arguments": {"command": "true"}}}]},
        {"role": "tool", "content": "done"}]
    for messages, expected in [(question, tool_call or ANSWER)] + ([(after_tool, ANSWER)] if tool_call else []):
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        out = model.generate(**prompt, max_new_tokens=16, do_sample=False)[0, prompt["input_ids"].shape[1]:].tolist()
        assert out[-1] == eos and tokenizer.decode(out[:-1]) == expected, tokenizer.decode(out)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    if (reason := unsupported()) is not None:
        pytest.skip(reason)
    path = tmp_path_factory.mktemp("scripted-agent-model")
    scripted_agent_model(path)
    # One thread: the model is 64 wide, and threads only contend on a busy machine.
    process = ServerProcess("--model", str(path), "--served-model-name", MODEL, "--api-key", KEY,
                            "--num-kv-blocks", "8192", env={"OMP_NUM_THREADS": "1"})
    yield process
    assert process.stop() == 0, process.output()
    assert "Traceback" not in process.output(), process.output()


@pytest.fixture(scope="module")
def proxy(server) -> Iterator[RecordingProxy]:
    recorder = RecordingProxy(server.url)
    yield recorder
    recorder.close()


# -- each agent: how it is configured, run, and read ------------------------------------------

@dataclass
class Agent:
    cli: AgentCli
    routes: tuple[str, ...]  # where it sends its model requests
    setup: Callable[[Path, str], dict[str, str]]  # (HOME, proxy URL) -> environment
    first: list[str]  # arguments of the first turn
    second: list[str]  # and of the second, continuing the session
    answer: Callable[[str], str]  # what it printed (stdout) -> its answer, asserting no error in it


def claude_env(home: Path, url: str) -> dict[str, str]:
    return {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": KEY, "ANTHROPIC_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL, "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1"}


def claude_answer(stdout: str) -> str:
    result = json.loads(stdout)
    assert result["subtype"] == "success" and not result["is_error"] and result["api_error_status"] is None, result
    return result["result"]


def codex_env(home: Path, url: str) -> dict[str, str]:
    (home / ".codex").mkdir()
    (home / ".codex" / "config.toml").write_text(f"""model = "{MODEL}"
model_provider = "roseinfer"
check_for_update_on_startup = false

[model_providers.roseinfer]
name = "roseinfer"
base_url = "{url}/v1"
env_key = "ROSEINFER_KEY"
wire_api = "responses"

[analytics]
enabled = false
""")
    codex_path = Path(install(CODEX)[0]).parent.parent / "codex-path"  # its ripgrep, as its npm wrapper adds
    return {"CODEX_HOME": str(home / ".codex"), "ROSEINFER_KEY": KEY, "PATH": f"{codex_path}:{os.environ['PATH']}"}


def codex_answer(stdout: str) -> str:
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    kinds = [event["type"] for event in events]
    assert "turn.failed" not in kinds and "error" not in kinds and kinds[-1] == "turn.completed", events
    items = [event["item"] for event in events if event["type"] == "item.completed"]
    # Its one complaint: a model it has no metadata for (context window, ...), said before the turn.
    errors = [item["message"] for item in items if item["type"] == "error"]
    assert all(message.startswith(f"Model metadata for `{MODEL}` not found") for message in errors), errors
    (message,) = [item["text"] for item in items if item["type"] == "agent_message"]
    return message


def opencode_env(home: Path, url: str) -> dict[str, str]:
    config = home / ".config" / "opencode"
    config.mkdir(parents=True)
    (config / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json", "model": f"roseinfer/{MODEL}", "small_model": f"roseinfer/{MODEL}",
        "autoupdate": False, "share": "disabled",
        "provider": {"roseinfer": {"npm": "@ai-sdk/openai-compatible", "name": "roseinfer",
                                   "options": {"baseURL": url + "/v1", "apiKey": KEY},
                                   "models": {MODEL: {"name": MODEL, "limit": {"context": 65536, "output": 4096}}}}}}))
    return {"XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local" / "share"),
            "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".local" / "state"),
            "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1"}


def opencode_answer(stdout: str) -> str:
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    kinds = [event["type"] for event in events]
    assert "error" not in kinds and kinds[-1] == "step_finish", events
    assert events[-1]["part"]["reason"] == "stop", events[-1]
    return "".join(event["part"]["text"] for event in events if event["type"] == "text")


def qwen_env(home: Path, url: str) -> dict[str, str]:
    (home / ".qwen").mkdir()
    (home / ".qwen" / "settings.json").write_text(json.dumps({
        "security": {"auth": {"selectedType": "openai"}}, "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False}, "general": {"disableAutoUpdate": True, "disableUpdateNag": True}}))
    return {"OPENAI_BASE_URL": url + "/v1", "OPENAI_API_KEY": KEY, "OPENAI_MODEL": MODEL}


def qwen_answer(stdout: str) -> str:
    events = json.loads(stdout)
    result = events[-1]
    assert result["type"] == "result" and result["subtype"] == "success" and not result["is_error"], result
    return result["result"]


AGENTS = {
    "claude-code": Agent(CLAUDE, ("/v1/messages",), claude_env, ["-p", FIRST, "--output-format", "json"],
                         ["-p", "--continue", SECOND, "--output-format", "json"], claude_answer),
    "codex": Agent(CODEX, ("/v1/responses",), codex_env, ["exec", "--skip-git-repo-check", "--json", FIRST],
                   ["exec", "resume", "--last", "--skip-git-repo-check", "--json", SECOND], codex_answer),
    "opencode": Agent(OPENCODE, ("/v1/chat/completions",), opencode_env, ["run", "--format", "json", FIRST],
                      ["run", "--continue", "--format", "json", SECOND], opencode_answer),
    "qwen-code": Agent(QWEN, ("/v1/chat/completions",), qwen_env, ["-p", FIRST, "--output-format", "json"],
                       ["--continue", "-p", SECOND, "--output-format", "json"], qwen_answer),
}


# -- what the server streamed -------------------------------------------------------------------

def streamed(exchange: Exchange) -> tuple[str, list[tuple[str, dict]], int]:
    """The text and tool calls (name, arguments) a model response carried, and the prompt tokens
    it read from the prefix cache, asserting that it was streamed whole (its protocol's last
    event, no error event)."""
    route = exchange.path.split("?")[0]
    if "text/event-stream" not in exchange.content_type:  # a whole response
        body = exchange.json()
        if route == "/v1/messages":
            return ("".join(b["text"] for b in body["content"] if b["type"] == "text"),
                    [(b["name"], b["input"]) for b in body["content"] if b["type"] == "tool_use"],
                    body["usage"]["cache_read_input_tokens"])
        message = body["choices"][0]["message"]
        return (message["content"] or "", [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                           for c in message.get("tool_calls") or []],
                body["usage"]["prompt_tokens_details"]["cached_tokens"])
    events = exchange.events()
    kinds = [event.get("type") for event in events]
    assert "error" not in kinds and "response.failed" not in kinds, events
    if route == "/v1/messages":
        assert kinds[-1] == "message_stop", kinds
        blocks: dict[int, dict] = {}
        for event in events:
            if event["type"] == "content_block_start":
                blocks[event["index"]] = {**event["content_block"], "text": "", "json": ""}
            elif event["type"] == "content_block_delta":
                delta = event["delta"]
                blocks[event["index"]]["text" if delta["type"] == "text_delta" else "json"] += \
                    delta.get("text", delta.get("partial_json", ""))
        return ("".join(b["text"] for b in blocks.values() if b["type"] == "text"),
                [(b["name"], json.loads(b["json"])) for b in blocks.values() if b["type"] == "tool_use"],
                events[0]["message"]["usage"]["cache_read_input_tokens"])
    if route == "/v1/responses":
        assert kinds[-1] == "response.completed", kinds
        items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        return ("".join(e["delta"] for e in events if e["type"] == "response.output_text.delta"),
                [(i["name"], json.loads(i["arguments"])) for i in items if i["type"] == "function_call"],
                events[-1]["response"]["usage"]["input_tokens_details"]["cached_tokens"])
    assert exchange.response.rstrip().endswith(b"data: [DONE]"), exchange.response[-200:]
    choices = [c["choices"][0] for c in events if c["choices"]]
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] in (["stop"], ["tool_calls"]), events
    calls: dict[int, list[str]] = {}
    for call in (call for c in choices for call in c["delta"].get("tool_calls") or []):
        name, arguments = calls.setdefault(call["index"], ["", ""])
        calls[call["index"]] = [name + (call["function"].get("name") or ""),
                                arguments + (call["function"].get("arguments") or "")]
    usage = [c["usage"] for c in events if c.get("usage")]
    return ("".join(c["delta"].get("content") or "" for c in choices),
            [(name, json.loads(arguments)) for name, arguments in calls.values()],
            usage[-1]["prompt_tokens_details"]["cached_tokens"] if usage else 0)


def assistant_turns(body: dict) -> list[str]:
    """The assistant's turns a request sends back (messages or Responses input items), as JSON."""
    turns = body.get("messages") or body.get("input") or []
    return [json.dumps(turn) for turn in turns if isinstance(turn, dict) and turn.get("role") == "assistant"]


def run(agent: Agent, arguments: list[str], home: Path, work: Path, env: dict[str, str]) -> str:
    done = subprocess.run([*install(agent.cli), *arguments], cwd=work, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-4000:])
    return agent.answer(done.stdout)


@pytest.mark.parametrize("name", list(AGENTS))
def test_agent_cli_answers_and_continues(name, server, proxy, tmp_path):
    agent = AGENTS[name]
    if agent.cli.node and (node_major() or 0) < agent.cli.min_node:
        pytest.skip(f"{agent.cli.spec} needs node >= {agent.cli.min_node}, this machine has {node_major()}")
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (work / "notes.txt").write_text("hello\n")
    env = {"HOME": str(home), "PATH": os.environ["PATH"], "LANG": "C.UTF-8", "TERM": "dumb", "NO_COLOR": "1"}
    env |= agent.setup(home, proxy.url)
    proxy.take()
    for turn, arguments in enumerate((agent.first, agent.second)):
        answer = run(agent, arguments, home, work, env)
        exchanges = proxy.take()
        assert [(x.method, x.path, x.status) for x in exchanges if x.status != 200] == [], \
            [x.response[:500] for x in exchanges if x.status != 200]
        # A request of the CLI's own that it stopped reading on exiting (opencode's title, say) is
        # not a response the server cut short: left out.
        model_calls = [x for x in exchanges if x.method == "POST" and x.path.split("?")[0] in agent.routes
                       and not x.client_left]
        assert model_calls, [x.path for x in exchanges]
        texts = [streamed(x) for x in model_calls]
        # Every answer the server wrote is the script's, and the CLI printed it.
        assert [(text, calls) for text, calls, _ in texts] == [(ANSWER, [])] * len(texts)
        assert answer.strip() == ANSWER
        if turn == 1:  # the conversation resent with the first answer as the assistant's, its prefix cached
            main = max(model_calls, key=lambda x: len(x.request))
            assert any(ANSWER in sent for sent in assistant_turns(main.request_json())), main.request_json()
            assert texts[model_calls.index(main)][2] > 0


# -- a file-editing task: the agent's shell tool, called by the model through the server -------

COMMAND = "echo world > notes"
TASK = "Put the word world into the file notes"
# The agent's shell tool, its command argument, and its command line (allowed to run the tool).
EDITING = {"claude-code": ("Bash", "command", ["-p", TASK, "--allowedTools=Bash", "--output-format", "json"]),
           "codex": ("exec_command", "cmd", ["exec", "--dangerously-bypass-approvals-and-sandbox",
                                             "--skip-git-repo-check", "--json", TASK]),
           "opencode": ("bash", "command", ["run", "--format", "json", TASK]),
           "qwen-code": ("run_shell_command", "command", ["--yolo", "-p", TASK, "--output-format", "json"])}


@pytest.mark.parametrize("name", list(AGENTS))
def test_agent_cli_edits_a_file_through_a_tool_call(name, tmp_path):
    agent = AGENTS[name]
    if (reason := unsupported()) is not None:
        pytest.skip(reason)
    if agent.cli.node and (node_major() or 0) < agent.cli.min_node:
        pytest.skip(f"{agent.cli.spec} needs node >= {agent.cli.min_node}, this machine has {node_major()}")
    tool, argument, arguments = EDITING[name]
    model = tmp_path / "model"
    scripted_agent_model(model, f'<tool_call>{{"name": "{tool}", "arguments": {{"{argument}": "{COMMAND}"}}}}</tool_call>')
    server = ServerProcess("--model", str(model), "--served-model-name", MODEL, "--api-key", KEY,
                           "--num-kv-blocks", "8192", env={"OMP_NUM_THREADS": "1"})
    recorder = RecordingProxy(server.url)
    try:
        home, work = tmp_path / "home", tmp_path / "work"
        home.mkdir()
        work.mkdir()
        (work / "notes").write_text("hello\n")
        env = {"HOME": str(home), "PATH": os.environ["PATH"], "LANG": "C.UTF-8", "TERM": "dumb", "NO_COLOR": "1"}
        env |= agent.setup(home, recorder.url)
        answer = run(agent, arguments, home, work, env)
        exchanges = recorder.take()
    finally:
        recorder.close()
        assert server.stop() == 0, server.output()
    assert "Traceback" not in server.output(), server.output()
    assert [(x.method, x.path, x.status) for x in exchanges if x.status != 200] == [], \
        [x.response[:500] for x in exchanges if x.status != 200]
    model_calls = [x for x in exchanges if x.method == "POST" and x.path.split("?")[0] in agent.routes
                   and not x.client_left]
    results = [streamed(x) for x in model_calls]
    # The task: the call streamed as the API's tool call, run by the agent, whose next request
    # carried the result (the only way the model writes ANSWER), which ended it.
    assert [calls for _, calls, _ in results if calls] == [[(tool, {argument: COMMAND})]], results
    assert results[-1][:2] == (ANSWER, []) and answer.strip() == ANSWER
    assert (work / "notes").read_text() == "world\n"
