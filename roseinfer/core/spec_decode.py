"""Draft tokens for speculative decoding without a draft model: n-gram prompt lookup.

If the sequence's last n tokens occurred before, the tokens that followed that earlier occurrence
are a likely continuation (a summary quoting its text, code being edited). The scheduler asks for
drafts for the requests that qualify, and the model runner verifies them all in one forward pass.
A request whose drafts keep being rejected stops proposing for a while, so text with no repeats
costs nothing.
"""

from __future__ import annotations

import numpy as np

from roseinfer.config import SpeculativeConfig
from roseinfer.core.request import Request

_WINDOW = 32  # drafts proposed before a request's acceptance rate is judged
_COOLDOWN_STEPS = 32  # steps without proposals for a request judged unlucky


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, request: Request, room: int) -> list[int]:
        """Up to `room` (and num_speculative_tokens) draft tokens for the request's next step."""
        if request.spec_cooldown > 0:
            request.spec_cooldown -= 1
            return []
        limit = min(room, self.config.num_speculative_tokens)
        if limit <= 0 or not _qualifies(request):
            return []
        return find_continuation(request.token_ids, self.config.prompt_lookup_min,
                                 self.config.prompt_lookup_max, limit)

    def record(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """After verification: judge the request's recent acceptance rate."""
        request.spec_proposed += num_proposed
        request.spec_accepted += num_accepted
        if request.spec_proposed >= _WINDOW:
            if request.spec_accepted < self.config.min_acceptance_rate * request.spec_proposed:
                request.spec_cooldown = _COOLDOWN_STEPS
            request.spec_proposed = request.spec_accepted = 0


def _qualifies(request: Request) -> bool:
    """Drafts are verified with the plain sampling rules only: not for requests whose every token
    needs its own state (logprobs, penalties, min_tokens still holding back EOS, logit bias, a
    grammar, a thinking budget)."""
    params = request.sampling_params
    return not (
        params.logprobs is not None
        or params.uses_penalties
        or request.num_output_tokens < params.min_tokens
        or params.logit_bias
        or params.structured_outputs is not None
        or (request.reasoning is not None and request.reasoning.budget is not None)
    )


def find_continuation(token_ids: list[int], min_n: int, max_n: int, limit: int) -> list[int]:
    """The up to `limit` tokens after the most recent earlier occurrence of the sequence's last
    n tokens, for the longest n in [min_n, max_n] that occurs."""
    length = len(token_ids)
    if length <= min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # all but the suffix itself
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + limit].tolist()
    return []
