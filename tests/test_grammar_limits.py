"""Grammars deep enough to overflow llguidance's stack (a SIGSEGV of the whole server before
grammar_limits.py) are refused with a 400 naming the field, before llguidance
sees them; the same shapes a little below the limits compile, on the threads that compile them."""

from __future__ import annotations

import json
import threading

import pytest

from roseinfer.errors import InvalidRequestError
from roseinfer.grammar_limits import (
    MAX_GBNF_RULES,
    MAX_RULE_DEPTH,
    MAX_SCHEMA_DEPTH,
    json_schema_depth,
    lark_rule_depth,
)
from roseinfer.structured_output import GrammarCompiler, StructuredOutputsParams


def ref_chain(length: int, shape: str) -> dict:
    """`$defs` d0 -> d1 -> ... -> d{length}, each step wrapped in `shape`."""
    def step(i: int) -> dict:
        ref = {"$ref": f"#/$defs/d{i + 1}"}
        return {"object": {"type": "object", "properties": {"a": ref}},
                "anyOf": {"anyOf": [ref, {"type": "null"}]},
                "array": {"type": "array", "items": ref},
                "bare": ref,
                "twice": {"anyOf": [ref, ref]}}[shape]
    return {"$defs": {f"d{i}": step(i) for i in range(length)} | {f"d{length}": {"type": "string"}},
            "$ref": "#/$defs/d0"}


def lark_chain(length: int) -> str:
    return "start: r0\n" + "\n".join(f'r{i}: "x" r{i + 1}' for i in range(length)) + f'\nr{length}: "y"\n'


def gbnf_chain(length: int) -> str:
    return "root ::= r0\n" + "\n".join(f'r{i} ::= "x" r{i + 1}' for i in range(length)) + f'\nr{length} ::= "y"\n'


# Levels each step of a chain adds (its definition, the wrapper's objects and lists, the $ref).
LEVELS_PER_STEP = {"object": 3, "anyOf": 3, "array": 2, "bare": 1, "twice": 3}


@pytest.mark.parametrize("shape", LEVELS_PER_STEP)
def test_ref_chains_are_measured_and_refused_past_the_limit(shape):
    steps = MAX_SCHEMA_DEPTH // LEVELS_PER_STEP[shape]
    assert json_schema_depth(ref_chain(steps - 3, shape)) <= MAX_SCHEMA_DEPTH
    # Crashed llguidance (SIGSEGV) at 1,000 object steps; refused now, before llguidance runs.
    with pytest.raises(InvalidRequestError) as caught:
        StructuredOutputsParams(json=ref_chain(3 * steps, shape)).validate()
    assert caught.value.param == "structured_outputs.json"
    assert f"at most {MAX_SCHEMA_DEPTH}" in str(caught.value)


def test_a_doubled_ref_chain_is_measured_in_linear_time():
    # Each step references the next twice: 2^2000 paths, one pass over 2,000 definitions.
    assert json_schema_depth(ref_chain(2000, "twice")) == MAX_SCHEMA_DEPTH + 1


def test_recursive_schemas_are_cycles_not_depth():
    tree = {"$defs": {"node": {"type": "object", "properties": {"children": {
        "type": "array", "items": {"$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"}
    assert json_schema_depth(tree) < 10
    assert json_schema_depth({"$ref": "#"}) == 1


def test_lark_and_gbnf_chains_are_refused_past_the_limits():
    assert lark_rule_depth(lark_chain(100)) == 102  # start, r0 .. r100
    with pytest.raises(InvalidRequestError) as caught:
        StructuredOutputsParams(grammar=lark_chain(5000)).validate()  # crashed llguidance
    assert caught.value.param == "structured_outputs.grammar" and f"at most {MAX_RULE_DEPTH}" in str(caught.value)
    with pytest.raises(InvalidRequestError) as caught:
        StructuredOutputsParams(grammar=gbnf_chain(20_000)).validate()  # minutes in the GBNF converter
    assert caught.value.param == "structured_outputs.grammar" and f"at most {MAX_GBNF_RULES}" in str(caught.value)
    # A JSON Schema inlined in Lark with llguidance's %json obeys the schema limit.
    inline = 'start: "x" %json ' + json.dumps(ref_chain(2000, "object"))
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_SCHEMA_DEPTH}"):
        StructuredOutputsParams(grammar=inline).validate()


def test_strings_and_regexes_are_not_references():
    grammar = 'start: a "b c start" /a|b/ // a comment naming b\na: "x"\nb: "y"\n'
    assert lark_rule_depth(grammar) == 2  # start -> a; b is only named inside literals


@pytest.mark.parametrize("shape", LEVELS_PER_STEP)
def test_chains_just_below_the_limit_compile(smollm_tokenizer, shape):
    """What passes the check must not crash llguidance: validated on a thread of default stack
    size (as the server's executor runs it) and compiled on the compiler's own threads."""
    params = StructuredOutputsParams(json=ref_chain(MAX_SCHEMA_DEPTH // LEVELS_PER_STEP[shape] - 3, shape))
    errors: list[BaseException] = []

    def validate() -> None:
        try:
            params.validate()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=validate)
    thread.start()
    thread.join()
    assert not errors, errors
    compiler = GrammarCompiler(smollm_tokenizer)
    try:
        assert compiler.compile(params).new_grammar() is not None
    finally:
        compiler.shutdown()


def test_rule_chains_just_below_the_limits_compile(smollm_tokenizer):
    compiler = GrammarCompiler(smollm_tokenizer)
    try:
        for grammar in (lark_chain(MAX_RULE_DEPTH - 3), gbnf_chain(MAX_RULE_DEPTH - 3)):
            params = StructuredOutputsParams(grammar=grammar)
            params.validate()
            assert compiler.compile(params).new_grammar() is not None
    finally:
        compiler.shutdown()
