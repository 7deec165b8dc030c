"""A seeded random walk through a grammar, for tests: the texts it produces are checked against
an independent reference (jsonschema, re.fullmatch, json.loads) by the tests that use it."""

from __future__ import annotations

import functools
import random
import string

import numpy as np
import torch

from roseinfer.structured_output import (
    GrammarCompiler,
    StructuredOutputsParams,
    allocate_bitmask,
    token_bytes_table,
)
from roseinfer.tokenizer import Tokenizer

WALK_BOUND = 3000  # tokens; the walks in the tests end within a few hundred


def is_sentencepiece(tokenizer: Tokenizer) -> bool:
    return "Metaspace" in tokenizer.backend.pre_tokenizer.__getstate__().decode()


def encode(compiler: GrammarCompiler, text: str) -> list[int]:
    """Ids that spell exactly `text` (sentencepiece's encode would put a space in front)."""
    return compiler.llg_tokenizer.tokenize_str(text)


def allowed_ids(bitmask: torch.Tensor, row: int = 0) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(bitmask[row].numpy().view(np.uint8), bitorder="little"))


@functools.cache
def punctuation_and_digit_tokens(tokenizer: Tokenizer) -> frozenset[int]:
    characters = (string.punctuation + string.digits).encode()
    return frozenset(
        i for i, b in enumerate(token_bytes_table(tokenizer)) if len(b) == 1 and b[0] in characters
    )


def random_walk(compiler: GrammarCompiler, tokenizer: Tokenizer, params: StructuredOutputsParams, seed: int) -> str:
    """Pick allowed tokens at random until the grammar is finished; the decoded text.

    Half of the picks are among the allowed single punctuation/digit tokens (when there are
    any), so that strings, numbers and runs of whitespace end within the bound; every pick
    comes from the grammar's bitmask either way."""
    short = punctuation_and_digit_tokens(tokenizer)
    grammar = compiler.compile(params).new_grammar()
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    rng = random.Random(seed)
    ids: list[int] = []
    while not grammar.is_terminated():
        assert len(ids) < WALK_BOUND, f"no end after {WALK_BOUND} tokens: {tokenizer.decode(ids)!r}"
        grammar.fill_bitmask(bitmask, 0)
        allowed = allowed_ids(bitmask).tolist()
        assert allowed, "the grammar allows nothing"
        if rng.random() < 0.5:
            allowed = [t for t in allowed if t in short] or allowed
        token = rng.choice(allowed)
        assert grammar.accept_tokens([token]), grammar.error
        ids.append(token)
    assert grammar.error is None
    # An end-of-sequence token the walk picked (allowed once the grammar accepts) is not text.
    return tokenizer.decode(ids, skip_special_tokens=True)
