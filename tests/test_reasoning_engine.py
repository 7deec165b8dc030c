"""Thinking models in the engine (`LLM(..., reasoning_parser=...)`), on tiny random Qwen3 models
with Qwen3's own chat templates: the thinking budget closes the thinking after exactly N tokens,
a grammar constrains only the answer, `enable_thinking` reaches the template, and the parser's
split of the real outputs matches the tokens the engine generated.

A random model never closes its thinking by itself, so the tests drive it: the thinking-only
template opens the thinking in the prompt, a budget closes it, and logit_bias makes the hybrid
template's model open it."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import transformers
from support import (
    EXACT,
    QWEN3_CHAT_TEMPLATE,
    QWEN3_THINKING_CHAT_TEMPLATE,
    tiny_hf_model,
    tiny_qwen3_thinking_model,
)

from roseinfer import LLM, SamplingParams
from roseinfer.common import serial
from roseinfer.common.messages import EngineCoreRequest, ReasoningSpec
from roseinfer.engine.input_processor import ChatPrompt, InputProcessor
from roseinfer.errors import InvalidRequestError
from roseinfer.models.loader import ModelSource
from roseinfer.reasoning import get_reasoning_parser
from roseinfer.structured_output import StructuredOutputsParams

ENGINE = EXACT | {"max_model_len": 256, "num_kv_blocks": 64}
QUESTION = [{"role": "user", "content": "What is two plus two?"}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}


def greedy(max_tokens: int, **fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **fields)


def json_answer(max_tokens: int = 48, **fields) -> SamplingParams:
    # No free whitespace: a random model would write it forever.
    return greedy(max_tokens, structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
                  **fields)


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory) -> Path:
    """Qwen3-Thinking-2507's template: the prompt opens <think>, the output starts inside it."""
    path = tmp_path_factory.mktemp("qwen3-thinking")
    tiny_qwen3_thinking_model(path, QWEN3_THINKING_CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> Path:
    """The hybrid Qwen3 template: the model may open <think> itself; enable_thinking=false closes it."""
    path = tmp_path_factory.mktemp("qwen3-hybrid")
    tiny_qwen3_thinking_model(path, QWEN3_CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def thinking_llm(thinking_dir) -> LLM:
    return LLM(str(thinking_dir), reasoning_parser="qwen3", **ENGINE)


@pytest.fixture(scope="module")
def hybrid_llm(hybrid_dir) -> LLM:
    return LLM(str(hybrid_dir), reasoning_parser="qwen3", **ENGINE)


def markup(llm: LLM) -> tuple[int, int]:
    tokenizer = llm.get_tokenizer()
    (start,) = tokenizer.encode("<think>", add_special_tokens=False)
    (end,) = tokenizer.encode("</think>", add_special_tokens=False)
    return start, end


def run(llm: LLM, params: SamplingParams, **chat):
    (output,) = llm.chat(QUESTION, params, use_tqdm=False, **chat)
    completion = output.outputs[0]
    assert completion.error is None, completion.error
    return output, completion


def split_of(llm: LLM, output, completion):
    return llm.llm_engine.reasoning_parser.split(completion.text, output.prompt)


def test_a_spent_budget_closes_the_thinking_after_exactly_n_tokens(thinking_llm):
    _, end = markup(thinking_llm)
    tokenizer = thinking_llm.get_tokenizer()
    output, free = run(thinking_llm, greedy(14))
    assert output.prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert end not in free.token_ids  # left alone, the random model never stops thinking
    assert split_of(thinking_llm, output, free).content is None
    for budget in (0, 1, 6):
        output, done = run(thinking_llm, greedy(14, thinking_token_budget=budget))
        ids = done.token_ids
        assert ids[:budget] == free.token_ids[:budget]  # the thinking itself as it was
        assert ids[budget] == end, (budget, ids)
        split = split_of(thinking_llm, output, done)
        assert split.reasoning == tokenizer.decode(ids[:budget])
        assert split.content == tokenizer.decode(ids[budget + 1:])
        assert split.reasoning + "</think>" + split.content == done.text


def test_every_sequence_of_n_has_its_own_budget(thinking_llm):
    _, end = markup(thinking_llm)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True, thinking_token_budget=4)
    (output,) = thinking_llm.chat(QUESTION, params, use_tqdm=False)
    assert len(output.outputs) == 3
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1  # sampled: the sequences differ
    for completion in output.outputs:
        assert completion.token_ids[4] == end


def test_a_grammar_constrains_the_answer_and_not_the_thinking(thinking_llm):
    _, end = markup(thinking_llm)
    _, free = run(thinking_llm, greedy(12))
    # No end of thinking, no answer: the grammar never starts, the thinking is the model's own.
    output, unfinished = run(thinking_llm, json_answer(12))
    assert unfinished.token_ids == free.token_ids
    assert split_of(thinking_llm, output, unfinished).content is None

    output, done = run(thinking_llm, json_answer(thinking_token_budget=5))
    assert done.token_ids[:5] == free.token_ids[:5] and done.token_ids[5] == end
    assert done.finish_reason == "stop"  # the grammar's answer is complete
    split = split_of(thinking_llm, output, done)
    jsonschema.validate(json.loads(split.content), SCHEMA)
    assert split.reasoning == thinking_llm.get_tokenizer().decode(free.token_ids[:5])


def test_enable_thinking_reaches_qwen3s_template_and_decides_where_the_output_starts(hybrid_llm, hybrid_dir):
    start, _ = markup(hybrid_llm)
    reference = transformers.AutoTokenizer.from_pretrained(hybrid_dir)
    params = greedy(3, logit_bias={start: 100})  # the random model now writes <think> every time

    output, thinking = run(hybrid_llm, params)
    assert output.prompt == reference.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert thinking.token_ids == [start] * 3
    split = split_of(hybrid_llm, output, thinking)  # the first <think> opens the thinking
    assert (split.reasoning, split.content) == ("<think><think>", None)

    output, answer = run(hybrid_llm, params, chat_template_kwargs={"enable_thinking": False})
    assert output.prompt == reference.apply_chat_template(
        QUESTION, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert output.prompt.endswith("<think>\n\n</think>\n\n")
    split = split_of(hybrid_llm, output, answer)  # the template closed the thinking: all answer
    assert (split.reasoning, split.content) == (None, "<think><think><think>")


def test_a_grammar_lets_a_hybrid_model_open_its_thinking_first(hybrid_llm):
    start, end = markup(hybrid_llm)
    # Given the choice between <think> and the grammar's first tokens, this random model opens a
    # thinking, which goes on as it would unconstrained (the same prompt with <think> appended).
    output, unbiased = run(hybrid_llm, json_answer(10))
    assert unbiased.token_ids[0] == start
    (free,) = hybrid_llm.generate(output.prompt + "<think>", greedy(9), use_tqdm=False)
    assert unbiased.token_ids[1:] == free.outputs[0].token_ids
    assert split_of(hybrid_llm, output, unbiased).content is None

    # Kept from <think>, it answers at once: the grammar holds from the first token.
    output, direct = run(hybrid_llm, json_answer(logit_bias={start: -100}))
    split = split_of(hybrid_llm, output, direct)
    assert split.reasoning is None
    jsonschema.validate(json.loads(split.content), SCHEMA)

    # Biased to <think>: it opens its thinking (allowed beside the grammar's first tokens), thinks
    # (unconstrained: the bias wins), the budget closes it, and the answer is the grammar's.
    output, thought = run(hybrid_llm, json_answer(thinking_token_budget=2, logit_bias={start: 100}))
    assert thought.token_ids[:4] == [start, start, start, end]
    split = split_of(hybrid_llm, output, thought)
    assert split.reasoning == "<think><think>"
    jsonschema.validate(json.loads(split.content), SCHEMA)

    # With the thinking closed by the template, <think> is not allowed first: the grammar holds.
    output, closed = run(hybrid_llm, json_answer(logit_bias={start: 100}),
                         chat_template_kwargs={"enable_thinking": False})
    assert start not in closed.token_ids
    jsonschema.validate(json.loads(split_of(hybrid_llm, output, closed).content), SCHEMA)


def test_deepseek_r1_output_starts_inside_the_thinking(hybrid_dir):
    llm = LLM(str(hybrid_dir), reasoning_parser="deepseek_r1", **ENGINE)
    _, end = markup(llm)
    output, done = run(llm, greedy(8, thinking_token_budget=3))
    assert not output.prompt.rstrip().endswith("<think>")  # the template did not open it here
    assert done.token_ids[3] == end
    split = split_of(llm, output, done)
    assert split.reasoning == llm.get_tokenizer().decode(done.token_ids[:3])
    assert split.content == llm.get_tokenizer().decode(done.token_ids[4:])


def test_a_budget_without_a_reasoning_parser_and_a_parser_without_single_tags_are_rejected(hybrid_dir, tmp_path):
    source = ModelSource.resolve(str(hybrid_dir))
    plain = InputProcessor(source.tokenizer(), source.model_config(), 256)
    with pytest.raises(InvalidRequestError, match="thinking_token_budget needs") as caught:
        plain.process("r", ChatPrompt(QUESTION), greedy(4, thinking_token_budget=2))
    assert caught.value.param == "thinking_token_budget"
    with pytest.raises(InvalidRequestError, match="thinking_token_budget must be a whole number >= 0"):
        greedy(4, thinking_token_budget=-1)

    tiny_hf_model("qwen3", tmp_path)  # a tokenizer without <think> as one token
    other = ModelSource.resolve(str(tmp_path))
    with pytest.raises(InvalidRequestError, match=r"needs '<think>' to be one token") as caught:
        InputProcessor(other.tokenizer(), other.model_config(), 256, get_reasoning_parser("qwen3"))
    assert caught.value.param == "reasoning_parser"
    with pytest.raises(InvalidRequestError, match="reasoning_parser must be one of deepseek_r1, harmony, qwen3"):
        get_reasoning_parser("qwq")


def test_the_reasoning_spec_travels_to_an_engine_core_process():
    params = SamplingParams(max_tokens=4, thinking_token_budget=3)
    request = EngineCoreRequest("r", [1, 2], params, [0], 0.0, reasoning=ReasoningSpec(376, 377, "thinking"))
    again = serial.decode(serial.encode(request))
    assert again.reasoning == request.reasoning and again.sampling_params.thinking_token_budget == 3
