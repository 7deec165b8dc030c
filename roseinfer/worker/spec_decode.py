"""Verifying draft tokens (speculative decoding) with the standard speculative-sampling rule.

The drafts come from n-gram lookup, a proposer that puts all its probability on one token, so the
rule is: draft d at a position is accepted with probability p(d) under the target distribution
there; at the first rejection the token is drawn from p with d removed (renormalized); if every
draft is accepted, one more token is drawn from the distribution after the last. Each position's
output is then distributed exactly as p: P(d) = p(d), P(t != d) = (1 - p(d)) * p(t) / (1 - p(d)).
Greedy requests accept a draft exactly when it is the argmax, which reproduces greedy decoding.
"""

from __future__ import annotations

import torch

from roseinfer.worker.request_state import CachedRequestState
from roseinfer.worker.sampler import Sampler
from roseinfer.worker.sampling_inputs import SamplingInputs


def verify_drafts(
    drafts: list[int],
    greedy_tokens: torch.Tensor,  # [len(drafts) + 1] argmax at each position
    probs: torch.Tensor | None,  # [len(drafts) + 1, vocab] target distributions; None for greedy
    generator: torch.Generator | None = None,
) -> list[int]:
    """The accepted drafts followed by one more token (a correction or the bonus)."""
    accepted: list[int] = []
    for position, draft in enumerate(drafts):
        if probs is None:
            target = int(greedy_tokens[position])
            if target != draft:
                return accepted + [target]
        else:
            p = probs[position]
            if float(torch.rand((), generator=generator)) >= float(p[draft]):
                residual = p.clone()
                residual[draft] = 0.0
                if float(residual.sum()) <= 0.0:  # p was all on the draft (rounding): keep it
                    return accepted + [draft]
                return accepted + [int(torch.multinomial(residual, 1, generator=generator))]
        accepted.append(draft)
    if probs is None:
        return accepted + [int(greedy_tokens[-1])]
    return accepted + [int(torch.multinomial(probs[-1], 1, generator=generator))]


def verify_requests(
    logits: torch.Tensor, entries: list[tuple[CachedRequestState, list[int], int]], sampler: Sampler,
    inputs: SamplingInputs,
) -> dict[str, list[int]]:
    """Each request's accepted drafts and one more token; `entries`: (request, its drafts, its
    first row of `logits`), a row per draft and one after."""
    rows = [r for _, drafts, start in entries for r in range(start, start + len(drafts) + 1)]
    expanded = [state for state, drafts, _ in entries for _ in range(len(drafts) + 1)]
    greedy, probs = sampler.probabilities(logits[rows], inputs.batch(expanded))
    tokens, offset = {}, 0
    for state, drafts, _ in entries:
        span = slice(offset, offset + len(drafts) + 1)
        params = state.sampling_params
        generator = inputs.generator(state) if params.seed is not None and not params.greedy else None
        tokens[state.req_id] = verify_drafts(
            drafts, greedy[span], None if params.greedy else probs[span], generator
        )
        offset += len(drafts) + 1
    return tokens
