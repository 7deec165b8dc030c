"""The engine core's side of structured outputs: each constrained request's grammar, compiled on a
thread pool off the engine loop, its rows of the step's token bitmask, and its advance over each
accepted token.

A request whose grammar is still compiling waits (the scheduler passes over it, the step goes on).
The tokenizer (for llguidance's view of the vocabulary) is loaded at the first constrained request.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import numpy as np

from roseinfer.config import EngineConfig, ModelConfig
from roseinfer.request import Request
from roseinfer.structured_output import (
    CompiledGrammar,
    GrammarCompiler,
    allocate_bitmask,
    fill_bitmasks,
)


class StructuredOutputManager:
    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self._config = config
        self._model_config = model_config
        self._compiler: GrammarCompiler | None = None
        self.mask_seconds = 0.0  # time spent filling bitmasks, and in how many steps (benchmarks)
        self.mask_steps = 0

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            from roseinfer.models.loader import ModelSource

            tokenizer = ModelSource.resolve(self._config.model, self._config.tokenizer).tokenizer()
            eos = set(self._model_config.eos_token_ids)
            if tokenizer.eos_token_id is not None:
                eos.add(tokenizer.eos_token_id)
            self._compiler = GrammarCompiler(tokenizer, vocab_size=self._model_config.vocab_size, eos_token_ids=eos)
        return self._compiler

    def add_request(self, request: Request) -> None:
        """Start compiling the request's grammar (cached by its text)."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        submitted = time.monotonic()
        future: Future[CompiledGrammar] = self.compiler.compile_async(params)
        request.grammar_future = future

        def compiled(_: Future) -> None:
            request.grammar_compile_time = time.monotonic() - submitted

        future.add_done_callback(compiled)

    def is_ready(self, request: Request) -> bool:
        """Whether the request can be scheduled: unconstrained, or its grammar has compiled (or
        failed to: then `request.grammar_error` says why)."""
        future = request.grammar_future
        if future is None or request.grammar is not None or request.grammar_error is not None:
            return True
        if not future.done():
            return False
        try:
            request.grammar = future.result().new_grammar()
        except Exception as exc:  # a grammar llguidance's quick check let through
            request.grammar_error = f"the structured output's grammar did not compile: {exc}"
        return True

    def bitmask(self, requests: list[Request]) -> tuple[np.ndarray | None, dict[str, int]]:
        """The allowed next tokens of each constrained request about to sample: an int32
        bitmask (a row per request) and request id -> row."""
        constrained = [r for r in requests if r.grammar is not None]
        if not constrained:
            return None, {}
        started = time.perf_counter()
        mask = allocate_bitmask(len(constrained), self.compiler.vocab_size)
        fill_bitmasks([(r.grammar, row) for row, r in enumerate(constrained)], mask)
        self.mask_seconds += time.perf_counter() - started
        self.mask_steps += 1
        return mask.numpy(), {r.request_id: row for row, r in enumerate(constrained)}

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()
