"""The text `roseinfer bench quality` scores, and its split into fixed-context chunks.

The corpus ships with the package (public-domain State of the Union addresses, see
data/README.md). Chunks follow llama.cpp's `llama-perplexity`: the token stream is cut into
consecutive windows of `n_ctx` tokens (a partial last window is dropped), each evaluated from an
empty cache, and only the second half of each window is scored, so that every scored token has
at least `n_ctx / 2` tokens of context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CORPUS = Path(__file__).parent / "data" / "sotu.txt"


@dataclass(frozen=True)
class ScoredSpan:
    """Within one chunk: the logits of rows `first .. n_ctx - 2` predict tokens `first + 1 ..`."""

    n_ctx: int

    @property
    def first(self) -> int:
        return self.n_ctx // 2

    @property
    def logit_rows(self) -> slice:
        return slice(self.first, self.n_ctx - 1)

    @property
    def target_positions(self) -> slice:
        return slice(self.first + 1, self.n_ctx)

    @property
    def num_scored(self) -> int:
        return self.n_ctx - 1 - self.first


def context_chunks(token_ids: Sequence[int], n_ctx: int, max_chunks: int | None = None) -> list[list[int]]:
    """Consecutive windows of `n_ctx` tokens (at most `max_chunks`); the remainder is not scored."""
    if n_ctx < 4:
        raise ValueError(f"the context of a chunk must be at least 4 tokens, got {n_ctx}")
    available = len(token_ids) // n_ctx
    if available == 0:
        raise ValueError(f"the text has {len(token_ids)} tokens, fewer than one chunk of {n_ctx}")
    if max_chunks is not None and max_chunks < 1:
        raise ValueError(f"the number of chunks must be at least 1, got {max_chunks}")
    count = available if max_chunks is None else min(available, max_chunks)
    return [list(token_ids[i * n_ctx : (i + 1) * n_ctx]) for i in range(count)]
