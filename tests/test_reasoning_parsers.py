"""The reasoning parsers on texts: whole responses split into thinking and answer, and the same
texts streamed in pieces cut at every UTF-8 byte boundary (as an incremental detokenizer hands
them out), which must add up to the whole split."""

from __future__ import annotations

import codecs

import pytest

from roseinfer.reasoning import (
    REASONING_PARSERS,
    Phase,
    ReasoningSplit,
    get_reasoning_parser,
)

QWEN3 = get_reasoning_parser("qwen3")
DEEPSEEK = get_reasoning_parser("deepseek_r1")

HYBRID_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # Qwen3: the model may open <think>
NO_THINKING_PROMPT = HYBRID_PROMPT + "<think>\n\n</think>\n\n"  # enable_thinking: false
OPENED_PROMPT = HYBRID_PROMPT + "<think>\n"  # Qwen3-Thinking-2507, DeepSeek-R1

# (parser, prompt, output) -> (reasoning, content)
CASES = [
    (QWEN3, HYBRID_PROMPT, "<think>\nLet me see.\n</think>\n\nIt is 4.", ("\nLet me see.\n", "\n\nIt is 4.")),
    (QWEN3, HYBRID_PROMPT, "It is 4.", (None, "It is 4.")),
    (QWEN3, HYBRID_PROMPT, "It is <think>not</think> 4.", (None, "It is <think>not</think> 4.")),
    (QWEN3, HYBRID_PROMPT, "<think>cut off mid-thought", ("cut off mid-thought", None)),
    (QWEN3, HYBRID_PROMPT, "<think></think>", ("", "")),
    (QWEN3, HYBRID_PROMPT, "", (None, "")),
    (QWEN3, HYBRID_PROMPT, "<thin", (None, "<thin")),  # never completed: text
    (QWEN3, NO_THINKING_PROMPT, "<think>x</think>y", (None, "<think>x</think>y")),
    (QWEN3, OPENED_PROMPT, "Hmm, 2+2.\n</think>\n\n4", ("Hmm, 2+2.\n", "\n\n4")),
    (QWEN3, OPENED_PROMPT, "still thinking </thi", ("still thinking </thi", None)),
    (QWEN3, OPENED_PROMPT, "a</think>b</think>c", ("a", "b</think>c")),  # the first end tag ends it
    (QWEN3, None, "<think>a</think>b", ("a", "b")),  # no prompt text: the parser's own rule
    (DEEPSEEK, "<｜User｜>hi<｜Assistant｜><think>\n", "Okay.\n</think>\n\nHi!", ("Okay.\n", "\n\nHi!")),
    (DEEPSEEK, "<｜User｜>hi<｜Assistant｜>", "<think>Okay.</think>Hi!", ("Okay.", "Hi!")),  # older template
    (DEEPSEEK, "<｜User｜>hi<｜Assistant｜>", "Okay.</think>Hi!", ("Okay.", "Hi!")),
    (DEEPSEEK, None, "no end tag at all", ("no end tag at all", None)),
    (DEEPSEEK, NO_THINKING_PROMPT, "Hi!", (None, "Hi!")),
    (DEEPSEEK, OPENED_PROMPT, "<think>x</think>y", ("x", "y")),  # a repeated opening tag is markup
    (QWEN3, OPENED_PROMPT, "思考中…\n</think>\n\n答えは４。", ("思考中…\n", "\n\n答えは４。")),
]


@pytest.mark.parametrize(("parser", "prompt", "text", "expected"), CASES)
def test_a_whole_response_splits_into_thinking_and_answer(parser, prompt, text, expected):
    assert parser.split(text, prompt) == ReasoningSplit(*expected)


def _utf8_pieces(text: str, cuts: list[int]) -> list[str]:
    """`text` as an incremental UTF-8 decoder hands it out when its bytes arrive cut at `cuts`."""
    data = text.encode()
    decoder = codecs.getincrementaldecoder("utf-8")()
    bounds = [0, *cuts, len(data)]
    return [decoder.decode(data[a:b], final=b == len(data)) for a, b in zip(bounds, bounds[1:], strict=False)]


def _streamed(parser, prompt, pieces: list[str]) -> tuple[str | None, str | None]:
    stream = parser.stream(prompt)
    reasoning = content = ""
    for piece in pieces:
        delta = stream.feed(piece)
        reasoning, content = reasoning + delta.reasoning, content + delta.content
    tail = stream.finish()
    reasoning, content = reasoning + tail.reasoning, content + tail.content
    return (reasoning if stream.thought else None), (content if stream.phase == Phase.ANSWERING else None)


@pytest.mark.parametrize(("parser", "prompt", "text", "expected"), CASES)
def test_streaming_cut_at_every_byte_boundary_adds_up_to_the_whole_split(parser, prompt, text, expected):
    size = len(text.encode())
    for cut in range(size + 1):  # two pieces, cut at every byte
        assert _streamed(parser, prompt, _utf8_pieces(text, [cut])) == expected, cut
    for first in range(size + 1):  # three pieces, every pair of cuts
        for second in range(first, size + 1):
            assert _streamed(parser, prompt, _utf8_pieces(text, [first, second])) == expected, (first, second)
    assert _streamed(parser, prompt, _utf8_pieces(text, list(range(1, size)))) == expected  # byte by byte


def test_a_partial_tag_is_held_back_until_the_next_piece_says_what_it_is():
    stream = QWEN3.stream(OPENED_PROMPT)
    delta = stream.feed("abc</th")
    assert (delta.reasoning, delta.content) == ("abc", "")
    delta = stream.feed("ink>\n\nAnswer")
    assert (delta.reasoning, delta.content) == ("", "\n\nAnswer")
    assert stream.phase == Phase.ANSWERING

    stream = QWEN3.stream(OPENED_PROMPT)
    assert stream.feed("a</t").reasoning == "a"
    assert stream.feed("able>").reasoning == "</table>"  # not the tag after all: thinking text

    stream = QWEN3.stream(HYBRID_PROMPT)
    assert not stream.feed("<th")  # a start tag or text: nothing is said yet
    assert stream.feed("ink>hm").reasoning == "hm"


@pytest.mark.parametrize(("prompt", "qwen3", "deepseek_r1"), [
    (HYBRID_PROMPT, Phase.UNDECIDED, Phase.THINKING),
    (OPENED_PROMPT, Phase.THINKING, Phase.THINKING),
    (OPENED_PROMPT + "  \n", Phase.THINKING, Phase.THINKING),
    (NO_THINKING_PROMPT, Phase.ANSWERING, Phase.ANSWERING),
    (None, Phase.UNDECIDED, Phase.THINKING),
])
def test_where_the_output_starts_comes_from_the_end_of_the_prompt(prompt, qwen3, deepseek_r1):
    assert QWEN3.initial_phase(prompt) == qwen3
    assert DEEPSEEK.initial_phase(prompt) == deepseek_r1


def test_the_registry_names_vllms_parsers_and_rejects_others_by_name():
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "harmony", "qwen3"]
    with pytest.raises(ValueError, match=r"reasoning_parser must be one of deepseek_r1, harmony, qwen3, got 'qwq'"):
        get_reasoning_parser("qwq")
