"""Structured outputs, tool calling and logit_bias end to end: a live `roseinfer serve` on the
default model driven by the official `openai` client, every JSON output checked with `jsonschema`;
tool_choice "auto" on a tiny random Qwen2 with a Hermes-style template; the offline API."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from live_server import ServerProcess, metric
from pydantic import BaseModel, Field
from support import EXACT_FLAGS, tiny_hf_model

from roseinfer import SamplingParams
from roseinfer.structured_output import StructuredOutputsParams

MODEL = "SmolLM2-135M-Instruct"

# Eight shapes, each bounded (strings, numbers, arrays, no extra properties) so that a 135M model's
# output ends by itself well within max_tokens.
NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {"person": {"type": "object", "properties": {"name": NAME, "age": {
            "type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"],
            "additionalProperties": False}},
        "required": ["person"], "additionalProperties": False,
    },
    "enum": {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"],
             "additionalProperties": False},
    "array": {"type": "object", "properties": {"fruits": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 3}},
              "required": ["fruits"], "additionalProperties": False},
    "bounded_int": {"type": "object", "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 10}},
                    "required": ["score"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {"answer": {"anyOf": [{"type": "boolean"}, {"enum": ["maybe"]}]}},
               "required": ["answer"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"city": NAME, "country": NAME}, "required": ["city"],
                 "additionalProperties": False},
    "closed": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
               "additionalProperties": False},
    "bounded_string": {"type": "object", "properties": {"word": {"type": "string", "pattern": "^[a-z]{3,8}$"}},
                       "required": ["word"], "additionalProperties": False},
}
PROMPTS = {
    "nested": "Describe a person as JSON.", "enum": "Pick a colour.", "array": "List some fruits.",
    "bounded_int": "Rate pizza from 1 to 10.", "any_of": "Is the sky blue?", "optional": "Where is the Eiffel Tower?",
    "closed": "Is water wet?", "bounded_string": "Give me one short word.",
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": NAME, "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False},
}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a city",
    "parameters": {"type": "object", "properties": {"city": NAME}, "required": ["city"], "additionalProperties": False},
}}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = ServerProcess("--kv-cache-memory", "0.25", *EXACT_FLAGS)
    yield process
    assert process.stop() == 0, process.output()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def json_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def test_json_schemas_greedy_and_sampled_streamed_and_not(server):
    async def one(http: openai.AsyncOpenAI, name: str, sampled: bool, stream: bool) -> tuple[str, str]:
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[name]}], max_tokens=200,
                      response_format=json_format(name), temperature=0.8 if sampled else 0.0,
                      seed=7 if sampled else None)
        if not stream:
            response = await http.chat.completions.create(**kwargs)
            return response.choices[0].message.content, response.choices[0].finish_reason
        text, finish = "", None
        async for chunk in await http.chat.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return text, finish

    async def run() -> list[tuple[str, bool, bool, str, str]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600) as http:
            cases = [(n, s, st) for n in SCHEMAS for s in (False, True) for st in (False, True)]
            results = await asyncio.gather(*(one(http, *case) for case in cases))
        return [(*case, *result) for case, result in zip(cases, results, strict=True)]

    outcomes = asyncio.run(run())
    assert len(outcomes) == 32
    for name, sampled, stream, text, finish in outcomes:
        where = f"{name} sampled={sampled} stream={stream}: {text!r}"
        assert finish == "stop", where
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    # Streamed and whole answers to the same request agree.
    by_case = {(n, s, st): t for n, s, st, t, _ in outcomes}
    for name in SCHEMAS:
        assert by_case[(name, False, False)] == by_case[(name, False, True)]
        assert by_case[(name, True, False)] == by_case[(name, True, True)]
    assert metric(server, "roseinfer:structured_output_requests_total") >= 32


def test_choice_regex_json_object_and_parse(client):
    choice = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=10, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no", "sometimes"]}})
    assert choice.choices[0].text in ("yes", "no", "sometimes") and choice.choices[0].finish_reason == "stop"
    pattern = r"\(\d{3}\) \d{3}-\d{4}"
    phone = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a phone number."}], max_tokens=30, temperature=0.9,
        seed=3, extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert re.fullmatch(pattern, phone.choices[0].message.content) and phone.choices[0].finish_reason == "stop"
    obj = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Return a JSON object with keys city and country for Paris."}],
        max_tokens=200, temperature=0, response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    text = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                          temperature=0, response_format={"type": "text"})
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                           temperature=0)
    assert text.choices[0].message.content == plain.choices[0].message.content

    class Book(BaseModel):
        title: str = Field(max_length=40)
        year: int = Field(ge=1000, le=2100)

    parsed = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe a famous book."}], max_tokens=100,
        temperature=0, response_format=Book,
    )
    assert isinstance(parsed.choices[0].message.parsed, Book)


def test_tool_choice_required_named_streamed_and_a_follow_up(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    required = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                              tool_choice="required", max_tokens=150, temperature=0)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])

    single = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=150, temperature=0.8, seed=1)
    assert len(single.choices[0].message.tool_calls) == 1

    named = {"type": "function", "function": {"name": "get_time"}}
    whole = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice=named,
                                           max_tokens=100, temperature=0)
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_time" and whole.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), schemas["get_time"])

    pieces: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice=named,
                                                max_tokens=100, temperature=0, stream=True):
        for delta_choice in chunk.choices:
            for delta in delta_choice.delta.tool_calls or []:
                entry = pieces.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                entry["id"] = entry["id"] or delta.id
                entry["name"] = entry["name"] or delta.function.name
                entry["arguments"] += delta.function.arguments or ""
            finish = delta_choice.finish_reason or finish
    assert finish == "tool_calls" and list(pieces) == [0]
    assert pieces[0]["name"] == "get_time" and pieces[0]["id"].startswith("call_")
    assert json.loads(pieces[0]["arguments"]) == json.loads(call.function.arguments)

    follow_up = messages + [
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in choice.message.tool_calls]},
        *({"role": "tool", "tool_call_id": c.id, "content": "18 C and sunny"} for c in choice.message.tool_calls),
    ]
    answer = client.chat.completions.create(model=MODEL, messages=follow_up, tools=[WEATHER, TIME], tool_choice="none",
                                            max_tokens=20, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_constrained_and_free_requests_share_steps(server, client):
    """16 constrained requests with different schemas beside 8 free greedy ones: every constrained
    output valid, every free output as when it ran alone."""
    free_prompts = [f"Tell me one fact about the number {i}." for i in range(8)]
    solo = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=24,
                                           temperature=0).choices[0].message.content for p in free_prompts]

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600) as http:
            constrained = [
                http.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[name]}],
                                             max_tokens=200, temperature=0.7, seed=i, response_format=json_format(name))
                for i, name in enumerate(list(SCHEMAS) * 2)
            ]
            free = [http.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=24,
                                                 temperature=0) for p in free_prompts]
            return await asyncio.gather(*constrained, *free)

    responses = asyncio.run(run())
    for name, response in zip(list(SCHEMAS) * 2, responses[:16], strict=True):
        jsonschema.validate(json.loads(response.choices[0].message.content), SCHEMAS[name])
    assert [r.choices[0].message.content for r in responses[16:]] == solo


def test_logit_bias(client, default_llm):
    tokenizer = default_llm.get_tokenizer()
    (comma,) = tokenizer.encode(",", add_special_tokens=False)
    forced = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0,
                                       logit_bias={str(comma): 100})
    assert forced.choices[0].text == ",,,,"
    first = default_llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    first_id = first.outputs[0].token_ids[0]
    banned = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1, temperature=0,
                                       logit_bias={str(first_id): -100})
    assert banned.choices[0].text != first.outputs[0].text
    offline = default_llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=4, logit_bias={comma: 100}),
                                   use_tqdm=False)[0]
    assert offline.outputs[0].text == ",,,,"


def test_logit_bias_becomes_a_tensor_once_per_request_not_once_per_step(default_llm, monkeypatch):
    import roseinfer.sampling_params as sampling_params_module

    class CountingBias(dict):  # counts the times the engine walks the entries
        walks = 0

        def _walked(self, entries):
            CountingBias.walks += 1
            return entries

        def items(self):
            return self._walked(super().items())

        def keys(self):
            return self._walked(super().keys())

        def values(self):
            return self._walked(super().values())

    checked = sampling_params_module._checked_logit_bias  # every copy of the params keeps counting
    monkeypatch.setattr(sampling_params_module, "_checked_logit_bias", lambda bias: CountingBias(checked(bias)))
    (comma,) = default_llm.get_tokenizer().encode(",", add_special_tokens=False)
    walks = []
    for max_tokens in (2, 12):
        CountingBias.walks = 0
        params = SamplingParams(temperature=0, max_tokens=max_tokens, logit_bias={comma: 100})
        (output,) = default_llm.generate("Once upon a time", params, use_tqdm=False)
        assert output.outputs[0].text == "," * max_tokens
        walks.append(CountingBias.walks)
    assert walks[0] == walks[1], walks  # the same for 2 and 12 steps (it was one walk a step)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "response_format.json_schema.schema",
         "nonsense"),
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex", "regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tool_choice": "required"}, "tool_choice", "only allowed when tools"),
        ({"frobnicate": True}, "frobnicate", "unknown field"),
        ({"functions": []}, "functions", "use `tools`"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "not a token id"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5", "less than or equal to 100"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "1025 entries, more than the limit of 1024"),
        # Integers past 64 bits, which llguidance's schema converter raises on.
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "string", "maxLength": 10**30}}}}, "response_format.json_schema.schema", "not JSON serializable"),
        ({"structured_outputs": {"json": {"type": "string", "maxLength": 10**30}}}, "structured_outputs.json",
         "not JSON serializable"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"const": 10**30}}}}}], "tool_choice": "required"}, "tools",
         "not JSON serializable"),
    ],
)
def test_bad_structured_requests_name_the_field(server, body, param, message):
    response = httpx.post(server.url + "/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4} | body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and re.search(message, error["message"]), error
    assert httpx.get(server.url + "/health").status_code == 200


def nested_tool_body(levels: int) -> str:
    """A "required" request whose tool's parameters nest `levels` objects (as JSON text: the
    client's own encoder cannot write the deepest ones)."""
    schema = '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + "}}" * levels
    return ('{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "tool_choice": "required", '
            '"tools": [{"type": "function", "function": {"name": "f", "parameters": ' + schema + "}}]}")


@pytest.mark.parametrize("levels", [48, 49, 100, 200, 300, 450, 600, 5000])
def test_deep_tool_schemas_meet_one_limit(server, levels):
    """Every field may nest MAX_NESTING_DEPTH levels of lists and objects (here tools, then its
    function, then 2 a level of schema). Up to it a request runs; past it, at any depth, it is a
    400 that says so, naming the field wherever the body is shallow enough for Python's JSON
    parser to read (before: llguidance's own 400 at 100 levels, a RecursionError's 500 from 200 to
    450, the JSON parser's 400 from 600)."""
    response = httpx.post(server.url + "/v1/chat/completions", content=nested_tool_body(levels),
                          headers={"Content-Type": "application/json"}, timeout=120)
    if levels == 48:  # 3 + 2 * 48 + 1 = MAX_NESTING_DEPTH levels
        assert response.status_code == 200, response.text
        return
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    if levels <= 450:
        assert error["param"] == "tools" and "nested more than 100 levels deep" in error["message"], error
    else:
        assert error["param"] is None and "too deeply to parse" in error["message"], error
    assert httpx.get(server.url + "/health").status_code == 200


def test_offline_structured_outputs_and_tools(default_llm):
    schema = SCHEMAS["nested"]
    outputs = default_llm.generate(
        ["A person:", "Another person:"],
        SamplingParams(temperature=0, max_tokens=100, structured_outputs=StructuredOutputsParams(json=schema)),
        use_tqdm=False,
    )
    for output in outputs:
        assert output.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(output.outputs[0].text), schema)
    (chat,) = default_llm.chat(
        [{"role": "user", "content": "Weather in Rome?"}],
        SamplingParams(temperature=0, max_tokens=60, structured_outputs={"choice": ["sunny", "rainy"]}),
        tools=[WEATHER], use_tqdm=False,
    )
    assert chat.outputs[0].text in ("sunny", "rainy")


# -- tool_choice "auto" with the model's own format ----------------------------------------------

HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\nAnswer with <tool_call>{...}</tool_call>."
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for call in m.get('tool_calls', []) %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.fixture(scope="module")
def hermes_server(tmp_path_factory) -> Iterator[ServerProcess]:
    path = tmp_path_factory.mktemp("qwen2") / "tiny-qwen2"
    tiny_hf_model("qwen2", path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": HERMES_TEMPLATE}))
    process = ServerProcess("--model", str(path), "--tool-call-parser", "hermes", "--served-model-name", "tiny")
    yield process
    assert process.stop() == 0, process.output()


def test_hermes_template_renders_tools_and_results(hermes_server):
    from roseinfer.engine.input_processor import ChatPrompt, InputProcessor
    from roseinfer.models.loader import ModelSource

    source = ModelSource.resolve(hermes_server.process.args[hermes_server.process.args.index("--model") + 1])
    processor = InputProcessor(source.tokenizer(), source.model_config(), 512)
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
    ]
    text = processor.render_chat(ChatPrompt(messages, tools=[WEATHER]))
    assert json.dumps(WEATHER) in text and "<tool_response>\n-3 C\n</tool_response>" in text
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text  # the arguments as an object


def test_auto_tool_choice_parses_the_models_format(hermes_server):
    http = openai.OpenAI(base_url=hermes_server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    # A random model writes no tool call of its own; a regex makes it write one in Hermes' format.
    force = {"structured_outputs": {"regex": re.escape(CALL_TEXT)}}
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    response = http.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=120,
                                            temperature=0, extra_body=force)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}

    deltas, finish = [], None
    for chunk in http.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=120,
                                              temperature=0, extra_body=force, stream=True):
        for delta_choice in chunk.choices:
            deltas.extend(delta_choice.delta.tool_calls or [])
            finish = delta_choice.finish_reason or finish
    assert finish == "tool_calls"
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Oslo"}

    free = http.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=8, temperature=0)
    assert free.choices[0].finish_reason in ("stop", "length") and not free.choices[0].message.tool_calls
