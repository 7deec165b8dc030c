"""roseinfer.structured_output: every text a grammar lets through, on real tokenizers, is checked
against an independent reference (jsonschema, re.fullmatch, json.loads, the choice list)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from grammar_walk import allowed_ids, encode, is_sentencepiece, random_walk
from support import tiny_tokenizer_json

from roseinfer.errors import InvalidRequestError
from roseinfer.structured_output import (
    GrammarCompiler,
    StructuredOutputsParams,
    allocate_bitmask,
    apply_bitmask,
    build_llg_tokenizer,
    fill_bitmasks,
    token_bytes_table,
)
from roseinfer.structured_output.llg_tokenizer import SPECIAL_TOKEN_MARKER
from roseinfer.tokenizer import Tokenizer

jsonschema = pytest.importorskip("jsonschema")

SCHEMAS: dict[str, dict] = {
    "nested_objects": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    "geo": {
                        "type": "object",
                        "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                        "required": ["lat", "lon"],
                        "additionalProperties": False,
                    },
                },
                "required": ["city", "zip", "geo"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            "level": {"enum": [1, 2, 3, None, True]},
        },
        "required": ["color", "size", "level"],
        "additionalProperties": False,
    },
    "bounded_arrays": {
        "type": "object",
        "properties": {
            "scores": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
            "labels": {
                "type": "array",
                "items": {"type": "string", "maxLength": 6},
                "minItems": 1,
                "maxItems": 2,
            },
        },
        "required": ["scores", "labels"],
        "additionalProperties": False,
    },
    "bounded_integers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "delta": {"type": "integer", "minimum": -5, "maximum": 5},
            "count": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 1000},
        },
        "required": ["age", "delta", "count"],
        "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [
                    {"type": "integer", "minimum": 0},
                    {"type": "string", "maxLength": 5},
                    {"type": "null"},
                    {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
                ]
            }
        },
        "required": ["value"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "nickname": {"type": "string", "maxLength": 8},
            "active": {"type": "boolean"},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["id"],
        "additionalProperties": False,
    },
    "open_object": {  # additionalProperties left open: extra keys are allowed
        "type": "object",
        "properties": {"kind": {"const": "event"}},
        "required": ["kind"],
    },
    "bounded_strings": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "minLength": 3, "maxLength": 3},
            "title": {"type": "string", "minLength": 2, "maxLength": 20},
            "slug": {"type": "string", "pattern": "^[a-z]+(-[a-z]+)*$", "maxLength": 15},
        },
        "required": ["code", "title", "slug"],
        "additionalProperties": False,
    },
    "top_level_array_with_refs": {  # the shape pydantic writes: $defs and $ref
        "$defs": {
            "Item": {
                "type": "object",
                "title": "Item",
                "properties": {
                    "sku": {"type": "string", "title": "Sku", "maxLength": 10},
                    "qty": {"type": "integer", "title": "Qty", "minimum": 1, "maximum": 99},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            }
        },
        "type": "array",
        "items": {"$ref": "#/$defs/Item"},
        "minItems": 1,
        "maxItems": 3,
    },
}


# -- tokenizers and compilers -------------------------------------------------------------------


@pytest.fixture(scope="module")
def json_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tokenizer-json")
    tiny_tokenizer_json(path)
    return Tokenizer.from_pretrained_dir(path)


@pytest.fixture(scope="module", params=["smollm_gguf", "tokenizer_json", "sentencepiece_gguf"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    name = {
        "smollm_gguf": "smollm_tokenizer",
        "tokenizer_json": "json_tokenizer",
        "sentencepiece_gguf": "tiny_spm_tokenizer",
    }[request.param]
    return request.getfixturevalue(name)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer):
    compiler = GrammarCompiler(tokenizer)
    yield compiler
    compiler.shutdown()


# -- the llguidance tokenizer ---------------------------------------------------------------------


TEXTS = ["Hello world, café!", '{"a": [1, 2.5, null]}', "  two  spaces\n\tand tab", "x"]


def test_token_bytes_spell_the_encoded_text(tokenizer):
    table = token_bytes_table(tokenizer)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        spelled = b"".join(table[i] for i in ids)
        # Sentencepiece encodes a space in front of text that does not start with one.
        assert spelled == text.encode() or (is_sentencepiece(tokenizer) and spelled == b" " + text.encode())
    assert table[tokenizer.eos_token_id].startswith(SPECIAL_TOKEN_MARKER)


def test_llguidance_encodes_forced_text_exactly(tokenizer):
    """llguidance encodes text a grammar forces with our tokenizer: the tokens must spell the
    text itself, with no sentencepiece space in front, and be the tokenizer's own choice."""
    llg = build_llg_tokenizer(tokenizer)
    table = token_bytes_table(tokenizer)
    for text in TEXTS:
        ids = llg.tokenize_str(text)
        assert b"".join(table[i] for i in ids) == text.encode()
    if not is_sentencepiece(tokenizer):
        assert llg.tokenize_str(TEXTS[0]) == tokenizer.encode(TEXTS[0], add_special_tokens=False)


def test_ids_past_the_vocabulary_are_never_allowed(tokenizer):
    compiler = GrammarCompiler(tokenizer, vocab_size=tokenizer.vocab_size + 40)
    grammar = compiler.compile(StructuredOutputsParams(regex=".{1,3}")).new_grammar()
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    grammar.fill_bitmask(bitmask, 0)
    allowed = allowed_ids(bitmask)
    assert len(allowed) > 10 and allowed.max() < tokenizer.vocab_size
    compiler.shutdown()


# -- what grammars let through --------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_walks_validate(compiler, tokenizer, name):
    schema = SCHEMAS[name]
    for params, seed in [
        (StructuredOutputsParams(json=schema), 0),
        (StructuredOutputsParams(json=json.dumps(schema)), 1),
        (StructuredOutputsParams(json=schema, disable_any_whitespace=True), 2),
    ]:
        text = random_walk(compiler, tokenizer, params, seed)
        jsonschema.validate(json.loads(text), schema)
        if params.disable_any_whitespace:
            outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
            assert not re.search(r"\s", outside_strings), text


def test_json_object_walks_parse(compiler, tokenizer):
    for seed in range(4):
        text = random_walk(compiler, tokenizer, StructuredOutputsParams(json_object=True), seed)
        assert isinstance(json.loads(text), dict)


def test_choice_is_exact(compiler, tokenizer):
    options = ["yes", "no", "maybe so", 'say "hi"', "naïve", "a\\b"]
    seen = {
        random_walk(compiler, tokenizer, StructuredOutputsParams(choice=options), seed)
        for seed in range(30)
    }
    assert seen <= set(options) and len(seen) >= 3


@pytest.mark.parametrize(
    "pattern", [r"[0-9]{3}-[a-z]{2,4}", r"(true|false)", r"[a-z0-9_.]+@example\.com", r"[A-Z][a-z]{0,6}!?"]
)
def test_regex_is_a_full_match(compiler, tokenizer, pattern):
    for seed in range(3):
        text = random_walk(compiler, tokenizer, StructuredOutputsParams(regex=pattern), seed)
        assert re.fullmatch(pattern, text), text


def test_lark_and_gbnf_grammars(compiler, tokenizer):
    lark = 'start: greeting " " NAME\ngreeting: "hi" | "hello"\nNAME: /[a-z]{1,5}/\n'
    gbnf = 'root ::= "item" [0-9] ("," " "? "item" [0-9])*\n'
    for seed in range(3):
        text = random_walk(compiler, tokenizer, StructuredOutputsParams(grammar=lark), seed)
        assert re.fullmatch(r"(hi|hello) [a-z]{1,5}", text), text
        text = random_walk(compiler, tokenizer, StructuredOutputsParams(grammar=gbnf), seed)
        assert re.fullmatch(r"item[0-9](, ?item[0-9])*", text), text


# -- the per-request grammar ----------------------------------------------------------------------


def test_rejected_token_reports_an_error(compiler, tokenizer):
    grammar = compiler.compile(StructuredOutputsParams(regex="[0-9]+")).new_grammar()
    letter = encode(compiler, "x")
    assert grammar.error is None
    assert not grammar.accept_tokens(letter)
    assert grammar.error and grammar.is_terminated()


def test_finished_grammar_allows_only_eos(compiler, tokenizer):
    grammar = compiler.compile(StructuredOutputsParams(choice=["ok"])).new_grammar()
    assert grammar.accept_tokens(encode(compiler, "ok"))
    assert grammar.is_terminated()
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    grammar.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask).tolist() == [tokenizer.eos_token_id]
    assert grammar.accept_tokens([tokenizer.eos_token_id]) and grammar.error is None


def test_rollback_restores_the_mask(compiler, tokenizer):
    grammar = compiler.compile(StructuredOutputsParams(json=SCHEMAS["enums"])).new_grammar()
    bitmask = allocate_bitmask(2, compiler.vocab_size)
    first = encode(compiler, '{"color')
    assert grammar.accept_tokens(first)
    grammar.fill_bitmask(bitmask, 0)
    assert grammar.accept_tokens(encode(compiler, '": "red"'))
    grammar.rollback(grammar.num_accepted - len(first))
    grammar.fill_bitmask(bitmask, 1)
    assert torch.equal(bitmask[0], bitmask[1])
    with pytest.raises(ValueError):
        grammar.rollback(len(first) + 1)


def test_batch_fill_matches_one_by_one(compiler, tokenizer):
    grammars = [
        compiler.compile(StructuredOutputsParams(json=SCHEMAS[name])).new_grammar()
        for name in sorted(SCHEMAS)
    ]
    for grammar in grammars[::2]:
        assert grammar.accept_tokens([allowed_first_token(grammar, compiler)])
    rows = len(grammars) + 2
    together, alone = allocate_bitmask(rows, compiler.vocab_size), allocate_bitmask(rows, compiler.vocab_size)
    fill_bitmasks([(g, row + 2) for row, g in enumerate(grammars)], together)
    for row, grammar in enumerate(grammars):
        grammar.fill_bitmask(alone, row + 2)
    assert torch.equal(together, alone)
    assert (together[:2] == -1).all()  # rows no grammar was given stay as allocated


# -- applying a bitmask -----------------------------------------------------------------------------


def test_apply_bitmask_masks_exactly_the_disallowed():
    vocab, extra = 100, 28  # the logits are wider than the bitmask covers (4 words = 128)
    torch.manual_seed(0)
    logits = torch.randn(5, vocab + extra + 40)
    original = logits.clone()
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32)
    rows = [4, 0, 2]
    apply_bitmask(logits, bitmask, rows)
    for i, row in enumerate(rows):
        bits = np.unpackbits(bitmask[i].numpy().view(np.uint8), bitorder="little").astype(bool)
        width = len(bits)
        assert torch.equal(logits[row, :width][bits], original[row, :width][bits])
        assert torch.isneginf(logits[row, :width][~bits]).all()
        assert torch.isneginf(logits[row, width:]).all()  # columns past the bitmask
    for row in (1, 3):  # rows without a grammar
        assert torch.equal(logits[row], original[row])


def test_both_ways_of_unpacking_agree_with_shifting():
    from roseinfer.structured_output.bitmask import _unpack, _unpack_on_device

    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 7), dtype=torch.int32)
    shifted = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten(1)
    assert torch.equal(_unpack(bitmask, torch.device("cpu")), shifted)
    assert torch.equal(_unpack_on_device(bitmask, torch.device("cpu")), shifted)  # the GPU way


def test_apply_bitmask_without_rows_uses_the_same_rows():
    logits = torch.zeros(2, 64)
    bitmask = torch.tensor([[1, 0], [0, -(2**31)]], dtype=torch.int32)  # token 0; token 63
    apply_bitmask(logits, bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [63]


# -- validation and errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "param", "words"),
    [
        ({"regex": "a(b"}, "structured_outputs.regex", "unclosed group"),
        ({"json": {"type": "frobnicate"}}, "structured_outputs.json", "frobnicate"),
        ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "structured_outputs.json", ""),
        ({"grammar": "start: missing_rule"}, "structured_outputs.grammar", "missing_rule"),
        ({"grammar": 'root ::= "a" undefined'}, "structured_outputs.grammar", "undefined"),
        ({"grammar": "root ::= ("}, "structured_outputs.grammar", ""),
        ({"json": {"type": "string"}, "whitespace_pattern": "[ "}, "structured_outputs.json", ""),
        # An integer past 64 bits: llguidance's converter raises (the schema never reaches its check).
        ({"json": {"type": "string", "maxLength": 10**30}}, "structured_outputs.json", "not JSON serializable"),
    ],
)
def test_bad_grammars_name_the_field(compiler, kwargs, param, words):
    params = StructuredOutputsParams(**kwargs)
    with pytest.raises(InvalidRequestError) as raised:
        params.validate()
    assert raised.value.param == param and words in str(raised.value)
    with pytest.raises(InvalidRequestError) as raised:
        compiler.compile(params)
    assert raised.value.param == param


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
        ({"json": {"type": "object"}, "json_object": True}, "structured_outputs"),
        ({}, "structured_outputs"),
        ({"json_object": False}, "structured_outputs"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"json": "[1, 2]"}, "structured_outputs.json"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a", 3]}, "structured_outputs.choice"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"grammar": 42}, "structured_outputs.grammar"),
        ({"regex": "a+", "disable_any_whitespace": True}, "structured_outputs.disable_any_whitespace"),
        ({"choice": ["a"], "whitespace_pattern": " *"}, "structured_outputs.whitespace_pattern"),
        (
            {"json_object": True, "disable_any_whitespace": True, "whitespace_pattern": " "},
            "structured_outputs.whitespace_pattern",
        ),
    ],
)
def test_bad_params_are_rejected_on_construction(kwargs, param):
    with pytest.raises(InvalidRequestError) as raised:
        StructuredOutputsParams(**kwargs)
    assert raised.value.param == param


def test_from_dict_names_unknown_and_unsupported_fields():
    assert StructuredOutputsParams.from_dict({"regex": "a+"}).kind == "regex"
    for key in ("structural_tag", "guided_json"):
        with pytest.raises(InvalidRequestError) as raised:
            StructuredOutputsParams.from_dict({"regex": "a+", key: "x"})
        assert raised.value.param == f"structured_outputs.{key}"


def test_cache_key_is_stable_and_keeps_property_order():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    as_dict = StructuredOutputsParams(json=schema)
    as_text = StructuredOutputsParams(json=json.dumps(schema, indent=2))
    assert as_dict.cache_key == as_text.cache_key
    reordered = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}
    assert StructuredOutputsParams(json=reordered).cache_key != as_dict.cache_key
    compact = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    assert compact.cache_key != as_dict.cache_key
    assert StructuredOutputsParams(regex="a").cache_key != StructuredOutputsParams(choice=["a"]).cache_key


def test_compile_cache_shares_one_compiled_grammar(compiler):
    first = compiler.compile_async(StructuredOutputsParams(json=SCHEMAS["enums"]))
    again = compiler.compile_async(StructuredOutputsParams(json=json.dumps(SCHEMAS["enums"])))
    other = compiler.compile_async(StructuredOutputsParams(json=SCHEMAS["any_of"]))
    assert first.result() is again.result()
    assert other.result() is not first.result()
    # Requests get their own state: advancing one leaves the other at the start.
    one, two = first.result().new_grammar(), first.result().new_grammar()
    assert one.accept_tokens([allowed_first_token(one, compiler)])
    assert two.num_accepted == 0 and one.matcher is not two.matcher


def test_compile_cache_is_bounded_by_bytes_and_keyed_by_digests(tokenizer: Tokenizer):
    import hashlib

    compiler = GrammarCompiler(tokenizer, cache_bytes=3000)
    try:
        grammars = [StructuredOutputsParams(choice=[f"{i}-" + "x" * 1000]) for i in range(5)]
        futures = [compiler.compile_async(g) for g in grammars]
        assert all(f.result() is not None for f in futures)
        keys = compiler.cached_keys()
        # ~1 KB each, 3000 bytes: the two newest stay (256 full texts were kept before).
        assert keys == [hashlib.sha256(g.cache_key.encode()).hexdigest() for g in grammars[-2:]]
        assert compiler.cached_bytes == sum(len(g.cache_key.encode()) for g in grammars[-2:]) <= 3000
        assert compiler.compile_async(grammars[-1]) is futures[-1]  # still shared
        assert compiler.compile_async(grammars[0]) is not futures[0]  # evicted: compiled again
        huge = StructuredOutputsParams(choice=["y" * 5000])  # alone past the bound: kept, alone
        compiler.compile(huge)
        assert compiler.cached_keys() == [hashlib.sha256(huge.cache_key.encode()).hexdigest()]
    finally:
        compiler.shutdown()


def test_failed_compilation_is_not_cached(compiler):
    params = StructuredOutputsParams(regex="(unclosed")
    first = compiler.compile_async(params)
    with pytest.raises(InvalidRequestError):
        first.result()
    assert compiler.compile_async(params) is not first


def allowed_first_token(grammar, compiler) -> int:
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    grammar.fill_bitmask(bitmask, 0)
    return int(allowed_ids(bitmask)[0])


def test_tokenizer_without_eos_is_refused(tmp_path: Path):
    tiny_tokenizer_json(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["eos_token"] = None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    from roseinfer.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="end-of-sequence"):
        build_llg_tokenizer(Tokenizer.from_pretrained_dir(tmp_path))
