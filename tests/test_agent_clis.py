"""The agent CLIs themselves against a live `roseinfer serve`: Claude Code (/v1/messages), Codex
(/v1/responses), opencode and Qwen Code (chat completions), each the pinned npm build (see
agent_clis.py) in its non-interactive mode, with a throwaway HOME, telemetry and updates off, and
pointed at the server through a recording proxy (recording_proxy.py).

Each agent asks a question, then continues the same session with a second one (its conversation
resent with the first answer in it). Checked: the CLI exits 0 with no error in its output; every
request it made was answered 200; every model response was streamed to its end; the answer it
printed is the text the server streamed; the second turn sent the first answer back as the
assistant's and read its prefix from the prefix cache.

The model is scripted so that an answer is known beforehand and quick to reach: a one-layer Llama
with the default model's tokenizer (the agents' 4-20k-token prompts tokenize as on the default
model, and are processed in seconds), whose next token depends on the last one only (see
`scripted_agent_model`): after the generation prompt it writes ANSWER and ends, whatever the prompt
and the temperature. transformers' own generation on it is the reference for that.
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

MODEL = "tiny-agent"
KEY = "agent-clis-key"
# The generation prompt of the default model's template ends "<|im_start|>assistant\n": "\n"
# starts the answer. Each token is one token of the tokenizer, none twice.
CHAIN = ["\n", "Hello", " from", " the", " tiny", " model", "."]
ANSWER = "".join(CHAIN[1:])
FIRST, SECOND = "What is 2+2?", "And 3+3?"
RUN_TIMEOUT = 300  # seconds for one CLI run


def scripted_agent_model(path: Path) -> None:
    """A tiny random Llama whose output follows CHAIN: each chain token's embedding is scaled to
    dominate the residual stream (attention and MLP add little to it), and the output head maps
    that token's direction to the next token's logit (then EOS), every other logit near 0."""
    import transformers

    vocab = write_default_tokenizer(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = [tokenizer.encode(piece, add_special_tokens=False) for piece in CHAIN]
    assert all(len(piece) == 1 for piece in ids) and len({i for (i,) in ids}) == len(ids), ids
    ids = [i for (i,) in ids]
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=65536, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for token, successor in zip(ids, [*ids[1:], tokenizer.eos_token_id], strict=True):
            embed[token] *= 20
            head[successor] = embed[token] / embed[token].norm() * 4
    model.save_pretrained(path)
    # The reference: transformers' generation writes ANSWER then EOS.
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": FIRST}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=16, do_sample=False)[0, prompt["input_ids"].shape[1]:].tolist()
    assert out[-1] == tokenizer.eos_token_id and tokenizer.decode(out[:-1]) == ANSWER, tokenizer.decode(out)


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

def streamed(exchange: Exchange) -> tuple[str, int]:
    """The text a model response carried and the prompt tokens it read from the prefix cache,
    asserting that it was streamed whole (its protocol's last event, no error event)."""
    route = exchange.path.split("?")[0]
    if "text/event-stream" not in exchange.content_type:  # a whole response
        body = exchange.json()
        if route == "/v1/messages":
            return "".join(b["text"] for b in body["content"] if b["type"] == "text"), \
                body["usage"]["cache_read_input_tokens"]
        return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"]["cached_tokens"]
    events = exchange.events()
    kinds = [event.get("type") for event in events]
    assert "error" not in kinds and "response.failed" not in kinds, events
    if route == "/v1/messages":
        assert kinds[-1] == "message_stop", kinds
        text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta"
                       and e["delta"]["type"] == "text_delta")
        return text, events[0]["message"]["usage"]["cache_read_input_tokens"]
    if route == "/v1/responses":
        assert kinds[-1] == "response.completed", kinds
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        return text, events[-1]["response"]["usage"]["input_tokens_details"]["cached_tokens"]
    assert exchange.response.rstrip().endswith(b"data: [DONE]"), exchange.response[-200:]
    assert [c["choices"][0]["finish_reason"] for c in events if c["choices"] and c["choices"][0]["finish_reason"]] \
        == ["stop"], events
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in events if c["choices"])
    usage = [c["usage"] for c in events if c.get("usage")]
    return text, usage[-1]["prompt_tokens_details"]["cached_tokens"] if usage else 0


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
        assert [text for text, _ in texts] == [ANSWER] * len(texts)
        assert answer.strip() == ANSWER
        if turn == 1:  # the conversation resent with the first answer as the assistant's, its prefix cached
            main = max(model_calls, key=lambda x: len(x.request))
            assert any(ANSWER in sent for sent in assistant_turns(main.request_json())), main.request_json()
            assert texts[model_calls.index(main)][1] > 0
