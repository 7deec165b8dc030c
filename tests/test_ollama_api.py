"""Ollama's API end to end: one real `roseinfer serve` (with an API key, the hermes tool-call
parser and --allow-pull against a Hub stand-in) driven by the official `ollama` client, checked
against the same server's OpenAI routes (the official `openai` client): the same greedy and seeded
text, the same prompt tokens, the same embeddings."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import httpx
import jsonschema
import ollama
import openai
import pytest
from hub_standin import HubStandin
from live_server import ServerProcess
from support import (
    EXACT_FLAGS,
    QWEN3_THINKING_CHAT_TEMPLATE,
    THINKING_MODEL,
    THINKING_SERVER_FLAGS,
    tiny_qwen3_thinking_model,
)

from roseinfer.server.ollama_api import _tool_calls
from roseinfer.tool_parsers import ToolCall

MODEL = "SmolLM2-135M-Instruct"
KEY = "ollama-test-key"
SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTION = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name three colours of the rainbow."}]
GREEDY = {"temperature": 0, "num_predict": 24}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def hub() -> Iterator[HubStandin]:
    with HubStandin() as standin:
        standin.add_repo("rose/pull-GGUF", {"pull-Q4_K_M.gguf": b"GGUF" + bytes(range(256)) * 8})
        yield standin


@pytest.fixture(scope="module")
def server(hub, tmp_path_factory) -> Iterator[ServerProcess]:
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path_factory.mktemp("hf-cache")), "HF_HUB_OFFLINE": "0"}
    process = ServerProcess(*EXACT_FLAGS, "--api-key", KEY, "--tool-call-parser", "hermes", "--allow-pull", env=env)
    yield process
    assert process.stop() == 0, process.output()


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


@pytest.fixture(scope="module")
def oa(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_chat_answers_the_openai_routes_greedy_text_whole_and_streamed(client, oa):
    reference = oa.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    text = reference.choices[0].message.content
    whole = client.chat(model=MODEL, messages=QUESTION, options=GREEDY, stream=False)
    assert whole.message.role == "assistant" and whole.message.content == text
    assert whole.done and whole.done_reason == ("length" if reference.choices[0].finish_reason == "length" else "stop")
    assert (whole.prompt_eval_count, whole.eval_count) == (reference.usage.prompt_tokens,
                                                           reference.usage.completion_tokens)
    chunks = list(client.chat(model=MODEL, messages=QUESTION, options=GREEDY, stream=True))
    assert len(chunks) > 3 and [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c.message.content for c in chunks) == text
    assert chunks[-1].eval_count == reference.usage.completion_tokens
    # /api/generate: the prompt in the chat template as a user turn (with `system`), or raw.
    generated = client.generate(model=MODEL, system=SYSTEM, prompt=QUESTION[1]["content"], options=GREEDY)
    assert generated.response == text
    raw_reference = oa.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=12)
    raw = client.generate(model=MODEL, prompt="The capital of France is", raw=True,
                          options={"temperature": 0, "num_predict": 12})
    assert raw.response == raw_reference.choices[0].text
    streamed = "".join(c.response for c in client.generate(model=MODEL, prompt="The capital of France is", raw=True,
                                                            options={"temperature": 0, "num_predict": 12},
                                                            stream=True))
    assert streamed == raw.response


def test_options_map_to_the_same_sampling(client, oa):
    options = {"temperature": 0.9, "top_k": 20, "top_p": 0.8, "seed": 7, "num_predict": 20, "stop": ["."],
               "presence_penalty": 0.5, "num_gpu": 99, "num_thread": 2}
    ours = client.chat(model=MODEL, messages=QUESTION, options=options)
    reference = oa.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0.9, top_p=0.8, seed=7,
                                           max_tokens=20, stop=["."], presence_penalty=0.5,
                                           extra_body={"top_k": 20})
    assert ours.message.content == reference.choices[0].message.content
    # num_ctx beyond the server's context is clamped to it; below it, prompt and answer must fit.
    big = client.chat(model=MODEL, messages=QUESTION, options=GREEDY | {"num_ctx": 1 << 20})
    assert big.message.content == client.chat(model=MODEL, messages=QUESTION, options=GREEDY).message.content
    prompt = big.prompt_eval_count
    tight = client.chat(model=MODEL, messages=QUESTION, options=GREEDY | {"num_ctx": prompt + 3})
    assert tight.eval_count == 3 and tight.done_reason == "length"
    with pytest.raises(ollama.ResponseError, match=f"the prompt has {prompt} tokens.*num_ctx 10") as error:
        client.chat(model=MODEL, messages=QUESTION, options=GREEDY | {"num_ctx": 10})
    assert error.value.status_code == 400


def test_format_json_and_a_schema_constrain_the_answer(client):
    answer = client.chat(model=MODEL, messages=[{"role": "user", "content": "Return a JSON object with keys city and "
                                                                  "country for Paris."}],
                         format="json", options={"temperature": 0, "num_predict": 200})
    assert answer.done_reason == "stop" and isinstance(json.loads(answer.message.content), dict)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    answer = client.chat(model=MODEL, messages=[{"role": "user", "content": "Describe a person."}], format=schema,
                         options={"temperature": 0, "num_predict": 60})
    jsonschema.validate(json.loads(answer.message.content), schema)


def test_tools_reach_the_template_and_the_tool_turns_as_openai_messages(client, oa):
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    ours = client.chat(model=MODEL, messages=ask, tools=[WEATHER], options=GREEDY)
    reference = oa.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER], temperature=0, max_tokens=24)
    assert ours.message.content == (reference.choices[0].message.content or "")
    assert [c.function.name for c in ours.message.tool_calls or []] == [
        c.function.name for c in reference.choices[0].message.tool_calls or []]
    assert ours.prompt_eval_count == reference.usage.prompt_tokens
    # A tool call and its result, in Ollama's shape (arguments an object, the result by tool_name).
    conversation = [*ask, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "18 C and sunny"}]
    ours = client.chat(model=MODEL, messages=conversation, tools=[WEATHER], options=GREEDY)
    as_openai = [*ask, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1_0", "name": "get_weather", "content": "18 C and sunny"}]
    reference = oa.chat.completions.create(model=MODEL, messages=as_openai, tools=[WEATHER], temperature=0,
                                           max_tokens=24)
    assert ours.prompt_eval_count == reference.usage.prompt_tokens
    assert ours.message.content == (reference.choices[0].message.content or "")


def test_list_show_ps_version_and_embed(client, oa, server):
    (listed,) = client.list().models
    assert listed.model == MODEL and listed.size > 50_000_000 and listed.details.format == "gguf"
    assert listed.details.family == "llama" and listed.details.quantization_level == "Q4_1"
    shown = client.show(MODEL)
    assert {"completion", "tools", "embedding"} <= set(shown.capabilities)
    assert shown.modelinfo["general.architecture"] == "llama" and "{% for" in shown.template
    assert 100e6 < shown.modelinfo["general.parameter_count"] < 200e6
    (running,) = client.ps().models
    assert running.model == MODEL and running.context_length > 0 and running.size_vram == 0  # on the CPU
    version = httpx.get(server.url + "/api/version", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert version["version"].count(".") == 2
    inputs = ["The sky is blue.", "Cats purr."]
    ours = client.embed(model=MODEL, input=inputs).embeddings
    reference = [d.embedding for d in oa.embeddings.create(model=MODEL, input=inputs).data]
    assert len(ours) == 2 and all(abs(a - b) < 1e-6 for x, y in zip(ours, reference, strict=True)
                                  for a, b in zip(x, y, strict=True))


def test_pull_fetches_into_the_cache(client, hub):
    progress = list(client.pull("hf.co/rose/pull-GGUF:Q4_K_M", stream=True))
    assert progress[0].status == "pulling manifest" and progress[-1].status == "success"
    assert any(p.startswith("/cdn/") for p in hub.paths("GET"))
    with pytest.raises(ollama.ResponseError, match="'rose/nothing' not found on http"):
        client.pull("rose/nothing", stream=False)


def test_bad_input_is_a_clear_error_in_ollamas_shape(client, server):
    cases = [
        (lambda: client.chat(model="llama3", messages=QUESTION), 404, "model 'llama3' not found"),
        (lambda: client.chat(model=MODEL, messages=QUESTION, options={"foo": 1}), 400, "unknown option.*foo"),
        (lambda: client.chat(model=MODEL, messages=QUESTION, options={"mirostat": 2}), 400, "mirostat=2"),
        (lambda: client.chat(model=MODEL, messages=QUESTION, think=True), 400, "does not support thinking"),
        (lambda: client.generate(model=MODEL, prompt="hi", suffix="end"), 400, "suffix"),
        (lambda: client.chat(model=MODEL, messages=[{"role": "user", "content": "What is it?", "images": [b"\x89PNG"]}]),
         400, r"messages\[0\].images\[0\]: this model takes no images"),
    ]
    for call, status, message in cases:
        with pytest.raises(ollama.ResponseError, match=message) as error:
            call()
        assert error.value.status_code == status
    # What the client itself would refuse to send, sent raw.
    raw = httpx.post(server.url + "/api/chat", headers={"Authorization": f"Bearer {KEY}"},
                     json={"model": MODEL, "messages": QUESTION, "format": "xml"})
    assert raw.status_code == 400 and raw.json() == {"error": "format must be \"json\" or a JSON schema object, "
                                                              "got 'xml'"}
    unauthorized = ollama.Client(host=server.url, timeout=30)
    with pytest.raises(ollama.ResponseError) as error:
        unauthorized.list()
    assert error.value.status_code == 401 and isinstance(error.value.error, str)


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory) -> Iterator[ServerProcess]:
    path = tmp_path_factory.mktemp("qwen3-thinking")
    tiny_qwen3_thinking_model(path, QWEN3_THINKING_CHAT_TEMPLATE)
    process = ServerProcess("--model", str(path), *THINKING_SERVER_FLAGS)
    yield process
    assert process.stop() == 0, process.output()


def test_think_splits_the_thinking_as_the_openai_route_does(thinking_server):
    client = ollama.Client(host=thinking_server.url, timeout=120)
    oa = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    ask = [{"role": "user", "content": "What is two plus two?"}]
    options = {"temperature": 0, "num_predict": 16}
    reference = oa.chat.completions.create(model=THINKING_MODEL, messages=ask, temperature=0, max_tokens=16)
    thinking = (reference.choices[0].message.model_extra or {}).get("reasoning_content")
    assert thinking
    ours = client.chat(model=THINKING_MODEL, messages=ask, think=True, options=options)
    assert ours.message.thinking == thinking and ours.message.content == (reference.choices[0].message.content or "")
    chunks = list(client.chat(model=THINKING_MODEL, messages=ask, think=True, options=options, stream=True))
    assert "".join(c.message.thinking or "" for c in chunks) == thinking
    assert "".join(c.message.content for c in chunks) == ours.message.content
    # think: false is the template's enable_thinking=false, as the OpenAI route's chat_template_kwargs.
    off = client.chat(model=THINKING_MODEL, messages=ask, think=False, options=options)
    off_reference = oa.chat.completions.create(model=THINKING_MODEL, messages=ask, temperature=0, max_tokens=16,
                                               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.prompt_eval_count == off_reference.usage.prompt_tokens
    assert off.message.content == (off_reference.choices[0].message.content or "")


# The keys and JSON types of the example responses in Ollama's API reference (docs/api.md of
# ollama/ollama): every one of them must be in our response, with the same type.
NUMBERS = {"total_duration": int, "load_duration": int, "prompt_eval_count": int, "prompt_eval_duration": int,
           "eval_count": int, "eval_duration": int}
MESSAGE = {"role": str, "content": str}
DETAILS = {"parent_model": str, "format": str, "family": str, "families": list, "parameter_size": str,
           "quantization_level": str}
DOCUMENTED = {
    "chat": {"model": str, "created_at": str, "message": MESSAGE, "done": bool, "done_reason": str} | NUMBERS,
    "chat chunk": {"model": str, "created_at": str, "message": MESSAGE, "done": bool},
    "chat tool call": {"message": {"role": str, "content": str, "tool_calls": [{"function": {
        "name": str, "arguments": dict}}]}, "done": bool},
    "load": {"model": str, "created_at": str, "message": MESSAGE, "done_reason": str, "done": bool},
    "generate": {"model": str, "created_at": str, "response": str, "done": bool, "done_reason": str} | NUMBERS,
    "generate chunk": {"model": str, "created_at": str, "response": str, "done": bool},
    "tags": {"models": [{"name": str, "modified_at": str, "size": int, "digest": str, "details": DETAILS}]},
    "show": {"modelfile": str, "parameters": str, "template": str, "details": DETAILS,
             "model_info": {"general.architecture": str, "general.parameter_count": int, "llama.context_length": int}},
    "ps": {"models": [{"name": str, "model": str, "size": int, "digest": str, "details": DETAILS,
                       "expires_at": str, "size_vram": int}]},
    "embed": {"model": str, "embeddings": [[float]], "total_duration": int, "load_duration": int,
              "prompt_eval_count": int},
    "embeddings": {"embedding": [float]},
    "pull": {"status": str},
}


def assert_shape(value, shape, where: str) -> None:
    if isinstance(shape, dict):
        assert isinstance(value, dict), where
        for key, inner in shape.items():
            assert key in value, f"{where}: no {key!r}"
            assert_shape(value[key], inner, f"{where}.{key}")
    elif isinstance(shape, list):
        assert isinstance(value, list) and value, where
        assert_shape(value[0], shape[0], f"{where}[0]")
    else:
        assert isinstance(value, shape) and not (shape is int and isinstance(value, bool)), f"{where}: {value!r}"


def test_every_response_has_the_shape_of_ollamas_documented_examples(server):
    def call(method: str, path: str, body: dict | None = None) -> list[dict]:
        response = httpx.request(method, server.url + path, json=body, timeout=120,
                                 headers={"Authorization": f"Bearer {KEY}"})
        assert response.status_code == 200, response.text
        return [json.loads(line) for line in response.text.splitlines() if line.strip()]

    chat = {"model": MODEL, "messages": QUESTION, "options": GREEDY}
    (whole,) = call("POST", "/api/chat", chat | {"stream": False})
    *chunks, final = call("POST", "/api/chat", chat)
    (generated,) = call("POST", "/api/generate", {"model": MODEL, "prompt": "Hi", "options": GREEDY, "stream": False})
    *generate_chunks, generate_final = call("POST", "/api/generate", {"model": MODEL, "prompt": "Hi",
                                                                      "options": GREEDY})
    rendered = {"message": {"role": "assistant", "content": "", "tool_calls": _tool_calls(
        [ToolCall("get_weather", '{"city": "Paris"}')])}, "done": True}  # what a turn that calls a tool sends
    responses = {
        "chat": [whole, final], "chat chunk": chunks, "load": call("POST", "/api/chat", {"model": MODEL, "messages": []}),
        "chat tool call": [rendered],
        "generate": [generated, generate_final], "generate chunk": generate_chunks,
        "tags": call("GET", "/api/tags"), "show": call("POST", "/api/show", {"model": MODEL}),
        "ps": call("GET", "/api/ps"), "embed": call("POST", "/api/embed", {"model": MODEL, "input": "Why?"}),
        "embeddings": call("POST", "/api/embeddings", {"model": MODEL, "prompt": "Why?"}),
        "pull": call("POST", "/api/pull", {"model": "rose/pull-GGUF", "stream": False}),
    }
    assert set(responses) == set(DOCUMENTED)
    for name, values in responses.items():
        assert values, name
        for value in values:
            assert_shape(value, DOCUMENTED[name], name)


def test_images_reach_a_vision_model_as_the_chat_routes_image_parts(tmp_path_factory):
    from test_vision import build_tiny_idefics3, image, reference

    path = tmp_path_factory.mktemp("idefics3")
    model, processor = build_tiny_idefics3(path)
    server = ServerProcess("--model", str(path), "--served-model-name", "tiny-vlm", *EXACT_FLAGS,
                           "--max-num-seqs", "2", "--kv-cache-memory", "0.05")
    try:
        client = ollama.Client(host=server.url, timeout=120)
        picture = image(1, (50, 70))
        prompt_ids, tokens = reference(model, processor, [picture], "What is in this image?", 6)
        png = io.BytesIO()
        picture.save(png, format="PNG")
        answer = client.chat(model="tiny-vlm", messages=[{"role": "user", "content": "What is in this image?",
                                                          "images": [png.getvalue()]}],
                             options={"temperature": 0, "num_predict": 6})
        assert answer.message.content == processor.tokenizer.decode(tokens, skip_special_tokens=True)
        assert answer.prompt_eval_count == len(prompt_ids)
        generated = client.generate(model="tiny-vlm", prompt="What is in this image?", images=[png.getvalue()],
                                    options={"temperature": 0, "num_predict": 6})
        assert generated.response == answer.message.content
        with pytest.raises(ollama.ResponseError, match=r"^images\[0\]") as error:
            client.generate(model="tiny-vlm", prompt="What is it?", images=[b"not an image"])
        assert error.value.status_code == 400
    finally:
        assert server.stop() == 0, server.output()
