"""The engine core's side of structured outputs: each constrained request's grammar, compiled on a
thread pool off the engine loop, and the step's token bitmask: a row per constrained request,
and one per thinking model's request whose thinking budget is spent (only its end token).

A request whose grammar is still compiling waits (the scheduler passes over it, the step goes on).
A request that ends before its grammar compiled (aborted: its client left, or it timed out) gives
up its claim on the compile, which is then cancelled or orphaned (structured_output/compile_pool.py);
a compile that runs past `--grammar-compile-timeout` fails its requests with a 400 naming the field.
The tokenizer (for llguidance's view of the vocabulary) is loaded at the first constrained request.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import numpy as np

from roseinfer.config import EngineConfig, ModelConfig
from roseinfer.core.request import Request
from roseinfer.errors import InvalidRequestError
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
            self._compiler = GrammarCompiler(tokenizer, vocab_size=self._model_config.vocab_size, eos_token_ids=eos,
                                             compile_timeout=self._config.grammar_compile_timeout)
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

    def release(self, request: Request) -> None:
        """The request ended: if its grammar is still compiling, it no longer waits for it."""
        future = request.grammar_future
        if future is not None and not future.done() and self._compiler is not None:
            self._compiler.release(future)

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
        except Exception as exc:  # a grammar llguidance's quick check let through, or a time-out
            error = self.compiler.error_of(request.sampling_params.structured_outputs, exc)
            if isinstance(error, InvalidRequestError):  # the request's own fault: a 400 naming the field
                request.grammar_error, request.grammar_error_param = str(error), error.param
            else:
                request.grammar_error = f"the structured output's grammar did not compile: {error}"
        return True

    def bitmask(self, requests: list[Request]) -> tuple[np.ndarray | None, dict[str, int]]:
        """The allowed next tokens of each request about to sample that has a rule for them: an
        int32 bitmask (a row per such request) and request id -> row.

        The rules: a grammar's row (a thinking model's grammar only once its answer began, and
        on its first token also the token that opens the thinking); a thinking that has spent its
        budget allows only its end token."""
        grammar_rows: list[Request] = []
        forced: list[tuple[Request, int]] = []
        for request in requests:
            tracker = request.reasoning
            token = tracker.forced_token() if tracker is not None else None
            if token is not None:
                forced.append((request, token))
            elif request.grammar is not None and (tracker is None or not tracker.thinking):
                grammar_rows.append(request)
        if not grammar_rows and not forced:
            return None, {}
        started = time.perf_counter()
        # One width for every row: the grammar's vocabulary once a grammar was compiled (the
        # model's logits, or wider), else the model's.
        width = self._compiler.vocab_size if self._compiler is not None else self._model_config.vocab_size
        mask = allocate_bitmask(len(grammar_rows) + len(forced), width)
        fill_bitmasks([(r.grammar, row) for row, r in enumerate(grammar_rows)], mask)
        words = mask.numpy().view(np.uint32)
        for row, request in enumerate(grammar_rows):
            if request.reasoning is not None and request.reasoning.undecided:
                _allow(words[row], request.reasoning.start_token_id)
        for row, (_, token) in enumerate(forced, start=len(grammar_rows)):
            words[row] = 0
            _allow(words[row], token)
        if grammar_rows:
            self.mask_seconds += time.perf_counter() - started
            self.mask_steps += 1
        rows = [r.request_id for r in grammar_rows] + [r.request_id for r, _ in forced]
        return mask.numpy(), {request_id: row for row, request_id in enumerate(rows)}

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()


def _allow(words: np.ndarray, token_id: int) -> None:
    """Set token_id's bit in a bitmask row (seen as uint32 words)."""
    words[token_id // 32] |= np.uint32(1 << (token_id % 32))
