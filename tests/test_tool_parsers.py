"""roseinfer.tool_parsers: recorded model texts (a call, several, none, malformed), streaming in
pieces of every size adding up to the same result, and tool_choice "required" / named schemas
checked by walking their grammars and validating with jsonschema."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from grammar_walk import random_walk
from hf_to_gguf import llama_cpp_chat_template

from roseinfer.errors import InvalidRequestError
from roseinfer.structured_output import GrammarCompiler, StructuredOutputsParams
from roseinfer.tool_parsers import (
    TOOL_PARSERS,
    ContentDelta,
    NamedToolCallStream,
    RequiredToolCallStream,
    ToolCallDelta,
    detect_tool_format,
    detect_tool_parser,
    extract_named_tool_call,
    extract_required_tool_calls,
    function_parameters,
    get_tool_parser,
    named_tool_schema,
    required_tool_calls_schema,
)

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
TIME = {"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}


def hermes_block(call: dict, spacing: str = "\n") -> str:
    return f"<tool_call>{spacing}{json.dumps(call)}{spacing}</tool_call>"


# (text, expected content, expected [(name, arguments dict)])
HERMES_CASES = {
    "one call": (hermes_block(WEATHER), None, [WEATHER]),
    "content then call": (
        "Let me check the weather for you.\n\n" + hermes_block(WEATHER),
        "Let me check the weather for you.",
        [WEATHER],
    ),
    "several calls": (
        hermes_block(WEATHER) + "\n" + hermes_block(TIME, spacing=""),
        None,
        [WEATHER, TIME],
    ),
    "no call": ("The capital of France is Paris.\n", "The capital of France is Paris.\n", []),
    "malformed json": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',
        [],
    ),
    "not a call object": (
        '<tool_call>{"function": "get_weather"}</tool_call>',
        '<tool_call>{"function": "get_weather"}</tool_call>',
        [],
    ),
    "cut off": (
        'Checking.\n<tool_call>\n{"name": "get_weather", "argu',
        'Checking.\n<tool_call>\n{"name": "get_weather", "argu',
        [],
    ),
    "valid and malformed": (
        hermes_block(WEATHER) + "\n<tool_call>{oops}</tool_call> done",
        "<tool_call>{oops}</tool_call> done",
        [WEATHER],
    ),
    "arguments as json text, unicode": (
        '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"café ☕\\"}"}</tool_call>',
        None,
        [{"name": "search", "arguments": {"q": "café ☕"}}],
    ),
    "text around and between": (
        "First.\n" + hermes_block(WEATHER) + "\nThen " + hermes_block(TIME) + " end <tool",
        "First.\n\nThen  end <tool",
        [WEATHER, TIME],
    ),
    "whitespace only": ("  \n", "  \n", []),
    "absurdly deep": ("<tool_call>" + "[" * 20_000 + "</tool_call>", None, []),
    "text before, blank lines after": (
        "  Sure.\n\n" + hermes_block(WEATHER) + "\n\n",
        "  Sure.",
        [WEATHER],
    ),
}

LLAMA3_CASES = {
    "one call": (
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        None,
        [WEATHER],
    ),
    "python tag": (
        '<|python_tag|>{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}',
        None,
        [TIME],
    ),
    "several calls": (
        ' {"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n',
        None,
        [WEATHER, TIME],
    ),
    "no call": ("Sure! It is sunny in Paris.", "Sure! It is sunny in Paris.", []),
    "plain json answer": ('{"answer": 42}', '{"answer": 42}', []),
    "malformed": (
        '{"name": "get_weather", "parameters": {"city": "Paris"}',
        '{"name": "get_weather", "parameters": {"city": "Paris"}',
        [],
    ),
    "trailing text": (
        '{"name": "get_time", "parameters": {}}; and more',
        '{"name": "get_time", "parameters": {}}; and more',
        [],
    ),
    "tag only": ("<|python_tag|>", "<|python_tag|>", []),
    "absurdly deep": ('{"name": "f", "parameters": ' + "[" * 20_000, None, []),
}

MISTRAL_CASES = {
    "json list (Nemo)": (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}, "id": "a1B2c3D4e"}]',
        None,
        [WEATHER],
    ),
    "named calls (Small 3.2, Devstral)": (
        'Checking.\n[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
        '[TOOL_CALLS]get_time[CALL_ID]x1y2z3[ARGS]{"timezone": "Europe/Paris"}',
        "Checking.",
        [WEATHER, TIME],
    ),
    "no call": ("It is sunny [in] Paris.", "It is sunny [in] Paris.", []),
    "malformed": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Par', '[TOOL_CALLS]get_weather[ARGS]{"city": "Par', []),
    "absurdly deep": ("[TOOL_CALLS]" + "[" * 20_000, None, []),
}

QWEN3_CODER_CASES = {
    "one call": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>",
        None,
        [WEATHER],
    ),
    "text, then two calls, typed values": (
        "Let me look.\n\n<tool_call>\n<function=get_time>\n<parameter=timezone>\nEurope/Paris\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=book>\n<parameter=hour>\n19\n</parameter>\n"
        "<parameter=names>\n[\"Ann\", \"Bo\"]\n</parameter>\n</function>\n</tool_call>\n",
        "Let me look.",
        [TIME, {"name": "book", "arguments": {"hour": 19, "names": ["Ann", "Bo"]}}],
    ),
    "no call": ("Paris is <b>sunny</b>.", "Paris is <b>sunny</b>.", []),
    "cut off": ("<tool_call>\n<function=get_time>\n<parameter=tim", "<tool_call>\n<function=get_time>\n<parameter=tim", []),
    "text after the calls": (
        "<tool_call>\n<function=f>\n</function>\n</tool_call> and then",
        "<tool_call>\n<function=f>\n</function>\n</tool_call> and then",
        [],
    ),
    "absurdly deep": ("<tool_call>" + "[" * 20_000, None, []),
}

for cases in (HERMES_CASES, LLAMA3_CASES, MISTRAL_CASES, QWEN3_CODER_CASES):  # malformed: content as written
    text, _, calls = cases["absurdly deep"]
    cases["absurdly deep"] = (text, text, calls)

CASES = [(parser, name, *case) for parser, cases in (
    ("hermes", HERMES_CASES), ("llama3_json", LLAMA3_CASES), ("mistral", MISTRAL_CASES),
    ("qwen3_coder", QWEN3_CODER_CASES)) for name, case in cases.items()]


def calls_as_dicts(calls) -> list[dict]:
    return [{"name": c.name, "arguments": json.loads(c.arguments)} for c in calls]


@pytest.mark.parametrize(("parser_name", "case", "text", "content", "expected"), CASES)
def test_extract_tool_calls(parser_name, case, text, content, expected):
    extracted = get_tool_parser(parser_name).extract_tool_calls(text)
    assert extracted.content == content
    assert calls_as_dicts(extracted.tool_calls) == expected
    ids = [call.id for call in extracted.tool_calls]
    assert all(i.startswith("call_") and len(i) == 29 for i in ids) and len(set(ids)) == len(ids)


def assemble(deltas) -> tuple[str | None, list[dict]]:
    """What an OpenAI client builds from the deltas: the content, and each call by index."""
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls: dict[int, dict] = {}
    for delta in (d for d in deltas if isinstance(d, ToolCallDelta)):
        wire = delta.to_openai()
        if delta.index not in calls:  # the first piece of a call names it
            assert wire["id"].startswith("call_") and wire["type"] == "function"
            calls[delta.index] = {"name": wire["function"]["name"], "arguments": ""}
        else:
            assert "id" not in wire and "name" not in wire["function"]
        calls[delta.index]["arguments"] += wire["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    ordered = [{**calls[i], "arguments": json.loads(calls[i]["arguments"])} for i in sorted(calls)]
    return (content or None) if ordered else content, ordered


def pieces(text: str, sizes) -> list[str]:
    out, position = [], 0
    for size in sizes:
        if position >= len(text):
            break
        out.append(text[position : position + size])
        position += size
    return out + ([text[position:]] if position < len(text) else [])


@pytest.mark.parametrize(("parser_name", "case", "text", "content", "expected"), CASES)
def test_streaming_adds_up_to_the_same_result(parser_name, case, text, content, expected):
    parser = get_tool_parser(parser_name)
    rng = random.Random(case)
    splits = [[size] * len(text) for size in range(1, min(len(text), 24) + 1)]
    splits += [[rng.randint(1, 9) for _ in text] for _ in range(20)]
    for sizes in splits:
        stream = parser.stream()
        deltas = [d for piece in pieces(text, sizes) for d in stream.feed(piece)] + stream.finish()
        assert assemble(deltas) == (content, expected), sizes
        assert stream.sent_tool_calls == bool(expected)


def test_hermes_content_streams_before_the_response_ends():
    stream = get_tool_parser("hermes").stream()
    deltas = stream.feed("Let me check the weather for you. <tool")
    assert [d.text for d in deltas] == ["Let me check the weather for you."]
    deltas = stream.feed("_call>" + json.dumps(WEATHER) + "</tool_call>")
    assert [d.name for d in deltas if isinstance(d, ToolCallDelta)] == ["get_weather", None]


def test_llama3_content_streams_once_it_is_not_a_call():
    stream = get_tool_parser("llama3_json").stream()
    assert stream.feed("  <|python") == []
    assert [d.text for d in stream.feed(" is a language")] == ["  <|python is a language"]
    assert [d.text for d in stream.feed("!")] == ["!"]


def test_registry():
    assert set(TOOL_PARSERS) >= {"hermes", "llama3_json", "mistral", "qwen3_coder"}
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nonesuch")


def test_qwen3_coder_types_values_by_the_tools_schema():
    tools = [{"type": "function", "function": {"name": "call", "parameters": {"type": "object", "properties": {
        "number": {"type": "string"}, "times": {"type": "integer"}}}}}]
    text = ("<tool_call>\n<function=call>\n<parameter=number>\n007\n</parameter>\n<parameter=times>\n3\n"
            "</parameter>\n</function>\n</tool_call>")
    (call,) = get_tool_parser("qwen3_coder", tools).extract_tool_calls(text).tool_calls
    assert json.loads(call.arguments) == {"number": "007", "times": 3}


# The tool-call format each real chat template writes (llama.cpp's collection, and the repo's own),
# as llama-server --jinja finds it; None: no tool-call markup, so tool_choice "auto" answers in text.
TEMPLATE_FORMATS = {
    "Qwen-Qwen2.5-7B-Instruct": "hermes", "Qwen-Qwen3-0.6B": "hermes", "Qwen-QwQ-32B": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "hermes", "ibm-granite-granite-4.0": "hermes",
    "Qwen3-Coder": "qwen3_coder", "Qwen3.5-4B": "qwen3_coder", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": "qwen3_coder",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3_json", "meta-llama-Llama-3.2-3B-Instruct": "llama3_json",
    "meta-llama-Llama-3.3-70B-Instruct": "llama3_json",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral", "Mistral-Small-3.2-24B-Instruct-2506": "mistral",
    "unsloth-mistral-Devstral-Small-2507": "mistral", "mistralai-Ministral-3-14B-Reasoning-2512": "mistral",
    # Known formats without a parser here: named, so they are not read as a simpler one.
    "GLM-4.6": "glm45", "deepseek-ai-DeepSeek-V3.1": "deepseek_v3", "Kimi-K2-Instruct": "kimi_k2",
    "openai-gpt-oss-120b": "harmony", "MiniMax-M3": "minimax", "google-gemma-4-31B-it": "gemma4",
    "google-gemma-2-2b-it": None, "microsoft-Phi-3.5-mini-instruct": None,
}
REPO_TEMPLATE_FORMATS = {"google-gemma-3-4b-it": None, "mistralai-Mixtral-8x7B-Instruct-v0.1": None,
                         "allenai-OLMoE-1B-7B-0924-Instruct": None}


@pytest.mark.parametrize(("name", "expected"), TEMPLATE_FORMATS.items())
def test_format_found_from_llama_cpps_templates(name, expected):
    assert detect_tool_format(llama_cpp_chat_template(name), TOOL_PARSERS) == expected


def test_format_found_from_the_repos_templates(smollm_tokenizer):
    for name, expected in REPO_TEMPLATE_FORMATS.items():
        template = (Path(__file__).parent / "chat_templates" / f"{name}.jinja").read_text()
        assert detect_tool_format(template, TOOL_PARSERS) == expected, name
    assert detect_tool_parser(smollm_tokenizer.chat_template)[0] is None  # the default model: text
    parser, line = detect_tool_parser(llama_cpp_chat_template("GLM-4.6"))
    assert parser is None and "glm45" in line and "no parser" in line
    assert detect_tool_parser(llama_cpp_chat_template("Qwen3-Coder"))[0] == "qwen3_coder"


def test_mistral_markers_are_special_tokens_the_response_keeps():
    assert get_tool_parser("mistral").keeps_special_tokens and not get_tool_parser("hermes").keeps_special_tokens


# -- tool_choice "required" and named --------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {  # the shape pydantic writes: $defs and $ref
        "type": "function",
        "function": {
            "name": "book_table",
            "parameters": {
                "$defs": {
                    "Guest": {
                        "type": "object",
                        "properties": {"name": {"type": "string", "maxLength": 10}},
                        "required": ["name"],
                        "additionalProperties": False,
                    }
                },
                "type": "object",
                "properties": {
                    "guests": {"type": "array", "items": {"$ref": "#/$defs/Guest"}, "maxItems": 2},
                    "hour": {"type": "integer", "minimum": 17, "maximum": 23},
                },
                "required": ["guests", "hour"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "ping"}},  # no parameters: any object
]


@pytest.fixture(scope="module")
def compiler(smollm_tokenizer):
    compiler = GrammarCompiler(smollm_tokenizer)
    yield compiler
    compiler.shutdown()


def test_required_tool_choice_walks_give_valid_calls(compiler, smollm_tokenizer):
    schema = required_tool_calls_schema(TOOLS)
    parameters = function_parameters(TOOLS)
    params = StructuredOutputsParams(json=schema)
    params.validate()
    names = set()
    for seed in range(12):
        text = random_walk(compiler, smollm_tokenizer, params, seed)
        jsonschema.validate(json.loads(text), schema)
        content, calls = extract_required_tool_calls(text)
        assert content is None and calls
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), parameters[call.name])
            names.add(call.name)
        stream = RequiredToolCallStream()
        deltas = [d for piece in pieces(text, [3] * len(text)) for d in stream.feed(piece)]
        assert assemble(deltas + stream.finish()) == (None, calls_as_dicts(calls))
    assert names == {"get_weather", "book_table", "ping"}


@pytest.mark.parametrize("name", ["get_weather", "book_table", "ping"])
def test_named_tool_choice_walks_give_valid_arguments(compiler, smollm_tokenizer, name):
    schema = named_tool_schema(TOOLS, name)
    for seed in range(3):
        text = random_walk(compiler, smollm_tokenizer, StructuredOutputsParams(json=schema), seed)
        content, (call,) = extract_named_tool_call(text, name)
        assert content is None and call.name == name
        jsonschema.validate(json.loads(call.arguments), schema)
        stream = NamedToolCallStream(name)
        deltas = [d for piece in pieces(text, [2] * len(text)) for d in stream.feed(piece)]
        assert assemble(deltas + stream.finish()) == (None, calls_as_dicts([call]))


def test_required_output_that_is_not_calls_is_content():
    for text in ['[{"name": "ping", "parameters": {}', "[]", '{"name": "ping", "parameters": {}}', "[" * 20_000]:
        assert extract_required_tool_calls(text) == (text, [])


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ([], "tools"),
        ([{"type": "retrieval"}], "tools[0]"),
        ([{"type": "function", "function": {"description": "no name"}}], "tools[0].function"),
        ([TOOLS[2], TOOLS[2]], "tools[1].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_tools_name_the_entry(tools, param):
    with pytest.raises(InvalidRequestError) as raised:
        required_tool_calls_schema(tools)
    assert raised.value.param == param


def test_named_tool_must_be_among_the_tools():
    with pytest.raises(InvalidRequestError) as raised:
        named_tool_schema(TOOLS, "launch_rocket")
    assert raised.value.param == "tool_choice" and "launch_rocket" in str(raised.value)
