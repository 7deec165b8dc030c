"""Grammar-constrained decoding with llguidance: what a request asks for (params), compiling and
tracking grammars (backend), and the per-step token bitmasks (bitmask)."""

from roseinfer.structured_output.backend import CompiledGrammar, Grammar, GrammarCompiler
from roseinfer.structured_output.bitmask import allocate_bitmask, apply_bitmask, fill_bitmasks
from roseinfer.structured_output.llg_tokenizer import build_llg_tokenizer, token_bytes_table
from roseinfer.structured_output_params import StructuredOutputsParams

__all__ = [
    "CompiledGrammar",
    "Grammar",
    "GrammarCompiler",
    "StructuredOutputsParams",
    "allocate_bitmask",
    "apply_bitmask",
    "build_llg_tokenizer",
    "fill_bitmasks",
    "token_bytes_table",
]
