"""gpt-oss's harmony format (reasoning/harmony.py, tool_parsers/harmony.py) on token sequences that
openai-harmony itself renders: the analysis channel is the reasoning, the final channel the
answer, messages to `functions.NAME` the tool calls, whole and streamed in any pieces; prompts
carry the tools, instructions and reasoning effort as the library renders them."""

import openai_harmony as harmony
import pytest
from harmony_vocab import ensure_o200k

ensure_o200k()  # openai-harmony's o200k vocabulary, offline (tests/harmony_vocab.py)

from roseinfer.reasoning import get_reasoning_parser  # noqa: E402
from roseinfer.reasoning.harmony import harmony_encoding, render_prompt  # noqa: E402
from roseinfer.tool_parsers import get_tool_parser  # noqa: E402


@pytest.fixture(scope="module")
def encoding():
    return harmony_encoding()


def completion(encoding, *messages) -> str:
    """What a model writes after the prompt's `<|start|>assistant`: the messages as openai-harmony
    renders them, less that opening, decoded with the special tokens kept."""
    tokens = []
    for message in messages:
        tokens += encoding.render(message)
    opening = encoding.encode("<|start|>assistant", allowed_special="all")
    assert tokens[:len(opening)] == opening
    return encoding.decode(tokens[len(opening):])


def _assistant(text: str, channel: str):
    return harmony.Message.from_role_and_content(harmony.Role.ASSISTANT, text).with_channel(channel)


def _call(name: str, arguments: str):
    return (_assistant(arguments, "commentary").with_recipient(f"functions.{name}")
            .with_content_type("<|constrain|>json"))


def _stream_reasoning(parser, text: str, step: int):
    stream = parser.stream(None)
    reasoning = content = ""
    for start in range(0, len(text), step):
        delta = stream.feed(text[start:start + step])
        reasoning, content = reasoning + delta.reasoning, content + delta.content
    delta = stream.finish()
    return reasoning + delta.reasoning, content + delta.content


def test_analysis_is_reasoning_and_final_is_content(encoding):
    text = completion(encoding, _assistant("The user greets. Reply kindly.", "analysis"),
                      _assistant("Hello! How can I help?", "final"))
    parser = get_reasoning_parser("harmony")
    split = parser.split(text)
    assert (split.reasoning, split.content) == ("The user greets. Reply kindly.", "Hello! How can I help?")
    for step in (1, 3, 7, 1000):
        assert _stream_reasoning(parser, text, step) == (split.reasoning, split.content)


def test_output_cut_off_inside_the_analysis(encoding):
    text = completion(encoding, _assistant("Still thinking about", "analysis"))
    text = text[: text.index("<|end|>")]
    split = get_reasoning_parser("harmony").split(text)
    assert split.reasoning == "Still thinking about" and split.content is None


def test_tool_calls_after_reasoning_through_both_parsers(encoding):
    """The reasoning parser takes the analysis; the tool parser reads the call from the answer it
    hands on, as the chat API chains them, whole and streamed."""
    text = completion(encoding, _assistant("Need the weather.", "analysis"),
                      _call("get_weather", '{"city": "Paris", "unit": "c"}'))
    reasoning = get_reasoning_parser("harmony")
    tools = get_tool_parser("harmony")
    split = reasoning.split(text)
    assert split.reasoning == "Need the weather."
    extracted = tools.extract_tool_calls(split.content)
    assert extracted.content is None
    assert [(c.name, c.arguments) for c in extracted.tool_calls] == [("get_weather", '{"city": "Paris", "unit": "c"}')]
    # Streamed: the reasoning stream's answer pieces through the tool stream.
    for step in (2, 9):
        stream, calls = reasoning.stream(None), tools.stream()
        deltas = []
        for start in range(0, len(text), step):
            deltas += calls.feed(stream.feed(text[start:start + step]).content)
        deltas += calls.feed(stream.finish().content) + calls.finish()
        named = [d for d in deltas if getattr(d, "name", None)]
        arguments = "".join(getattr(d, "arguments", "") for d in deltas)
        assert [d.name for d in named] == ["get_weather"] and arguments == '{"city": "Paris", "unit": "c"}'
        assert calls.sent_tool_calls


def test_tool_parser_alone_on_the_whole_completion(encoding):
    text = completion(encoding, _assistant("Two lookups.", "analysis"), _call("lookup", '{"q": "a"}'),
                      _call("lookup", '{"q": "b"}'))
    extracted = get_tool_parser("harmony").extract_tool_calls(text)
    assert [c.arguments for c in extracted.tool_calls] == ['{"q": "a"}', '{"q": "b"}']


def test_prompt_renders_tools_instructions_and_effort(encoding):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    messages = [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning_content": "Call the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    tokens = render_prompt(messages, tools, reasoning_effort="high")
    text = encoding.decode(tokens)
    assert "Reasoning: high" in text
    assert "Answer in French." in text and "get_weather" in text and "Weather of a city" in text
    assert text.endswith("<|start|>assistant")
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp": 21}<|end|>' in text
    # The library's own rendering of the same conversation.
    m = harmony.Message
    expected = harmony.Conversation.from_messages([
        m.from_role_and_content(harmony.Role.SYSTEM,
                                harmony.SystemContent.new().with_reasoning_effort(harmony.ReasoningEffort.HIGH)),
        m.from_role_and_content(harmony.Role.DEVELOPER, harmony.DeveloperContent.new()
                                .with_instructions("Answer in French.")
                                .with_function_tools([harmony.ToolDescription.new(
                                    "get_weather", "Weather of a city", parameters=tools[0]["function"]["parameters"])])),
        m.from_role_and_content(harmony.Role.USER, "Weather in Paris?"),
        _assistant("Call the tool.", "analysis"),
        _call("get_weather", '{"city": "Paris"}'),
        m.from_author_and_content(harmony.Author.new(harmony.Role.TOOL, "functions.get_weather"), '{"temp": 21}')
        .with_channel("commentary").with_recipient("assistant"),
    ])
    assert tokens == list(encoding.render_conversation_for_completion(expected, harmony.Role.ASSISTANT))
    low = encoding.decode(render_prompt(messages[1:2], reasoning_effort="low"))
    assert "Reasoning: low" in low
    with pytest.raises(ValueError, match="reasoning_effort must be one of low, medium, high"):
        render_prompt(messages[1:2], reasoning_effort="extreme")


def test_gpt_oss_prompts_are_harmonys(encoding):
    """The chat format the engine picks for gpt-oss: openai-harmony's rendering, the APIs' efforts
    as harmony's three levels, and the turn ended by <|return|> or <|call|>."""
    from roseinfer.chat_format import chat_format_for
    from roseinfer.server.effort import effort_of_budget

    assert chat_format_for("llama") is None
    chat_format = chat_format_for("gpt_oss")
    assert (chat_format.reasoning_parser, chat_format.tool_parser) == ("harmony", "harmony")
    assert sorted(chat_format.stop_token_ids()) == sorted(
        encoding.encode("<|return|><|call|>", allowed_special="all"))
    messages = [{"role": "user", "content": "Hi"}]
    for effort, level in (("none", "low"), ("minimal", "low"), ("medium", "medium"), ("xhigh", "high"), ("max", "high")):
        assert chat_format.render(messages, None, effort) == render_prompt(messages, reasoning_effort=level)
    with pytest.raises(ValueError, match="reasoning_effort must be one of"):
        chat_format.render(messages, None, "extreme")
    assert [effort_of_budget(b) for b in (0, 512, 513, 2048, 2049)] == ["low", "low", "medium", "medium", "high"]
