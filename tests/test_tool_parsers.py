"""roseinfer.tool_parsers: recorded model texts (a call, several, none, malformed), streaming in
pieces of every size adding up to the same result, and tool_choice "required" / named schemas
checked by walking their grammars and validating with jsonschema."""

from __future__ import annotations

import json
import random

import pytest
from grammar_walk import random_walk

from roseinfer.errors import InvalidRequestError
from roseinfer.structured_output import GrammarCompiler, StructuredOutputsParams
from roseinfer.tool_parsers import (
    TOOL_PARSERS,
    ContentDelta,
    NamedToolCallStream,
    RequiredToolCallStream,
    ToolCallDelta,
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

for cases in (HERMES_CASES, LLAMA3_CASES):  # malformed: the text comes back as content
    text, _, calls = cases["absurdly deep"]
    cases["absurdly deep"] = (text, text, calls)

CASES = [("hermes", name, *case) for name, case in HERMES_CASES.items()] + [
    ("llama3_json", name, *case) for name, case in LLAMA3_CASES.items()
]


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
    assert set(TOOL_PARSERS) >= {"hermes", "llama3_json"}
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nonesuch")


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
