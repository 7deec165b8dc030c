"""Grammars with llguidance: compiled on a small pool of threads off the caller's thread (with a
time limit, and given up on when no request waits any more: compile_pool.py), cached by a SHA-256
digest of the grammar's text, and tracked per request (allowed next tokens, accepted tokens,
termination)."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future

import llguidance
import llguidance.numpy
import torch

from roseinfer.errors import InvalidRequestError
from roseinfer.structured_output.compile_pool import CompilePool, CompileTimeout
from roseinfer.structured_output.llg_tokenizer import build_llg_tokenizer
from roseinfer.structured_output_params import StructuredOutputsParams
from roseinfer.tokenizer import Tokenizer


class Grammar:
    """One request's place in its grammar. Not thread-safe: one owner at a time."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.num_accepted = 0  # how far `rollback` may go

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance over sampled tokens. False (and `error` says why) when one is not allowed:
        the grammar then stays in that error state."""
        for token_id in token_ids:
            if not self.matcher.consume_token(int(token_id)):
                return False
            self.num_accepted += 1
        return True

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids`, in order, the grammar would accept (nothing is accepted)."""
        return self.matcher.validate_tokens([int(t) for t in token_ids])

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (CPU, from `allocate_bitmask`)."""
        llguidance.numpy.fill_next_token_bitmask(self.matcher, bitmask.numpy(), row)

    def is_terminated(self) -> bool:
        """The output is complete: nothing but an end-of-sequence token may follow (also true
        after an error)."""
        return self.matcher.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens (rejected speculative tokens)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} accepted tokens")
        if num_tokens and not self.matcher.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback failed: {self.matcher.get_error()}")
        self.num_accepted -= num_tokens

    @property
    def error(self) -> str | None:
        """Why the grammar stopped accepting tokens, or None."""
        if not self.matcher.is_error():
            return None
        return self.matcher.get_error() or "unknown grammar error"


class CompiledGrammar:
    """A compiled grammar, shared by every request that asks for the same one."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._initial = matcher  # never advanced: requests start from copies of it

    def new_grammar(self) -> Grammar:
        """A fresh per-request state at the start of the grammar (a cheap copy)."""
        return Grammar(self._initial.deep_copy())


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer on `max_workers` threads; the same
    grammar text is compiled once and its CompiledGrammar shared. The cache is keyed by a SHA-256
    digest of the text and keeps the most recent grammars whose texts total at most `cache_bytes`
    bytes (UTF-8) and number at most `cache_size` (the newest is kept whatever its size).

    `vocab_size` is the model's logits width when larger than the tokenizer's vocabulary;
    `eos_token_ids` are the ids that may end a finished grammar (default: the tokenizer's EOS).
    `compile_timeout` (seconds; None: none) bounds one compile's running time; a waiter that no
    longer needs a grammar says so with `release` (see compile_pool.py).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        vocab_size: int | None = None,
        eos_token_ids: Iterable[int] | None = None,
        max_workers: int = 2,
        cache_size: int = 256,
        cache_bytes: int = 16 << 20,
        compile_timeout: float | None = None,
    ) -> None:
        self.llg_tokenizer = build_llg_tokenizer(
            tokenizer, vocab_size=vocab_size, eos_token_ids=eos_token_ids
        )
        self.vocab_size: int = self.llg_tokenizer.vocab_size
        self.compile_timeout = compile_timeout or None
        self.pool: CompilePool[CompiledGrammar] = CompilePool(max_workers, timeout=self.compile_timeout)
        self._cache: OrderedDict[str, tuple[Future[CompiledGrammar], int]] = OrderedDict()  # digest -> (future, bytes of the text)
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self._cached_bytes = 0
        self._lock = threading.Lock()

    def compile_async(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """A future of the compiled grammar; it raises InvalidRequestError naming the field
        when the grammar does not compile (see `error_of` for the pool's own failures). The
        caller is one of its waiters until the future is done or it calls `release`."""
        text = params.cache_key.encode()
        key = hashlib.sha256(text).hexdigest()
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None and self.pool.join(entry[0]):
                self._cache.move_to_end(key)
                return entry[0]
            if entry is not None:  # given up on (its requests were aborted): compile it anew
                del self._cache[key]
                self._cached_bytes -= entry[1]
            future = self.pool.submit(lambda: self._compile(params))
            self._cache[key] = (future, len(text))
            self._cached_bytes += len(text)
            while len(self._cache) > 1 and (
                len(self._cache) > self._cache_size or self._cached_bytes > self._cache_bytes
            ):
                self._cached_bytes -= self._cache.popitem(last=False)[1][1]
        future.add_done_callback(lambda done: self._forget_failure(key, done))
        return future

    @property
    def cached_bytes(self) -> int:
        """The total size of the cached grammars' texts (what `cache_bytes` bounds)."""
        with self._lock:
            return self._cached_bytes

    def cached_keys(self) -> list[str]:
        """The cache's keys (digests), oldest first."""
        with self._lock:
            return list(self._cache)

    def release(self, future: Future[CompiledGrammar]) -> None:
        """A waiter of `future` (from compile_async) no longer needs it: its request ended."""
        self.pool.release(future)

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """compile_async, waited for."""
        future = self.compile_async(params)
        try:
            return future.result()
        except CompileTimeout as exc:
            raise self.error_of(params, exc) from exc

    def error_of(self, params: StructuredOutputsParams, exc: BaseException) -> Exception:
        """The request's error for a failed compile: a time-out names the field and the flag."""
        if isinstance(exc, CompileTimeout):
            return InvalidRequestError(
                f"{params.param}: the grammar {exc} (--grammar-compile-timeout); a smaller schema "
                "or grammar compiles faster", param=params.param)
        return exc if isinstance(exc, Exception) else RuntimeError(str(exc))

    def shutdown(self) -> None:
        self.pool.shutdown()

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        text = params.grammar_text
        # LLMatcher never raises for a bad grammar: it starts in an error state instead.
        matcher = llguidance.LLMatcher(self.llg_tokenizer, text, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(
                f"invalid {params.param}: {matcher.get_error().strip()}", param=params.param
            )
        return CompiledGrammar(matcher)

    def _forget_failure(self, key: str, future: Future[CompiledGrammar]) -> None:
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                entry = self._cache.get(key)
                if entry is not None and entry[0] is future:
                    del self._cache[key]
                    self._cached_bytes -= entry[1]
