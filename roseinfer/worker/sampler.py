"""Sampling the next token of every row of a batch at once.

Order (as in vLLM): raw log-probabilities for reporting, logit bias, the structured-output grammar's
token bitmask, min-tokens masking (unless it would leave a constrained row nothing), penalties,
then greedy rows take the argmax while the others go through temperature, min-p, top-k and top-p and are
sampled by the exponential race (argmax of p / q with q ~ Exp(1)), which lets seeded rows draw
their noise from their own generator so that their samples do not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from roseinfer.layers.cpu_kernels import cpu_kernels
from roseinfer.structured_output.bitmask import apply_bitmask


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors; fields a batch does not use are None."""

    temperature: torch.Tensor  # [B] float, 0 for greedy rows
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [B] long, vocab size where disabled
    top_p: torch.Tensor | None = None  # [B] float, 1 where disabled
    min_p: torch.Tensor | None = None  # [B] float, 0 where disabled
    presence_penalty: torch.Tensor | None = None  # [B]
    frequency_penalty: torch.Tensor | None = None  # [B]
    repetition_penalty: torch.Tensor | None = None  # [B], 1 where disabled
    output_counts: torch.Tensor | None = None  # [B, V] how often each token was generated
    seen_mask: torch.Tensor | None = None  # [B, V] token occurs in the prompt or the output
    banned: list[tuple[int, list[int]]] = field(default_factory=list)  # (row, ids) under min_tokens
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # seeded rows
    max_logprobs: int | None = None  # top-N alternatives wanted by any row (None: none)
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, token ids, biases)
    bitmask: torch.Tensor | None = None  # [len(bitmask_rows), words] int32: allowed tokens
    bitmask_rows: list[int] = field(default_factory=list)  # the logits row of each bitmask row


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] long
    logprobs: torch.Tensor | None = None  # [B] log-probability of the sampled token
    top_ids: torch.Tensor | None = None  # [B, N]
    top_logprobs: torch.Tensor | None = None  # [B, N]


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if _argmax_only(batch):  # the max of bfloat16 logits is the max of their float copies
            return SamplerOutput(greedy_tokens(logits))
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.max_logprobs is not None else None

        if batch.logit_bias is not None or batch.bitmask is not None or batch.banned:
            logits = logits.clone()
        if batch.logit_bias is not None:
            logits.index_put_(batch.logit_bias[:2], batch.logit_bias[2], accumulate=True)
        if batch.bitmask is not None:
            apply_bitmask(logits, batch.bitmask, batch.bitmask_rows)
        for row, token_ids in batch.banned:
            kept = logits[row].clone()
            logits[row, token_ids] = float("-inf")
            if torch.isinf(logits[row]).all():  # a grammar that can only end here ends here
                logits[row] = kept
        logits = apply_penalties(logits, batch)

        if batch.all_greedy:
            sampled = greedy_tokens(logits)
        else:
            sampled = self._sample(logits, batch)
        return self._with_logprobs(sampled, raw_logprobs, batch)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy_rows = batch.temperature == 0
        greedy = greedy_tokens(logits)
        probs = self._probabilities(logits, batch)
        noise = torch.empty_like(probs).exponential_()
        for row, generator in batch.generators.items():
            noise[row].exponential_(generator=generator)
        random = (probs / noise.clamp_(min=1e-20)).argmax(dim=-1)  # an exact 0 would win wrongly
        return torch.where(greedy_rows, greedy, random)

    def probabilities(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's greedy token and, unless every row is greedy, the distribution a sample is
        drawn from (after temperature, min-p, top-k and top-p). For verifying draft tokens, whose
        requests have no penalties, bias, grammar or min_tokens (see core/spec_decode.py)."""
        logits = logits.float()
        greedy = greedy_tokens(logits)
        return greedy, None if batch.all_greedy else self._probabilities(logits, batch)

    @staticmethod
    def _probabilities(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy_rows = batch.temperature == 0
        temperature = torch.where(greedy_rows, torch.ones_like(batch.temperature), batch.temperature)
        logits = logits / temperature[:, None]
        if batch.min_p is not None:
            logits = apply_min_p(logits, batch.min_p)
        if batch.top_k is not None:
            logits = apply_top_k(logits, batch.top_k)
        if batch.top_p is not None:
            logits = apply_top_p(logits, batch.top_p)
        return torch.softmax(logits, dim=-1)

    @staticmethod
    def _with_logprobs(
        sampled: torch.Tensor, raw_logprobs: torch.Tensor | None, batch: SamplingBatch
    ) -> SamplerOutput:
        if raw_logprobs is None:
            return SamplerOutput(sampled)
        chosen = raw_logprobs.gather(1, sampled[:, None]).squeeze(1)
        top_ids = top_values = None
        if batch.max_logprobs:
            top_values, top_ids = raw_logprobs.topk(batch.max_logprobs, dim=-1)
        return SamplerOutput(sampled, chosen, top_ids, top_values)


def _argmax_only(batch: SamplingBatch) -> bool:
    """Every row greedy with nothing that changes or reports the logits."""
    return (
        batch.all_greedy and batch.max_logprobs is None and batch.logit_bias is None and batch.bitmask is None
        and not batch.banned and batch.repetition_penalty is None and batch.frequency_penalty is None
        and batch.presence_penalty is None
    )


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row (the first on ties, like argmax). On the CPU the C++ kernel (two
    vectorised passes a row) is several times faster than `max`, itself 2-3x faster than `argmax`."""
    kernels = cpu_kernels() if logits.device.type == "cpu" and logits.dtype != torch.float64 else None
    if kernels is not None and logits.dim() == 2 and logits.stride(-1) == 1:
        return kernels.argmax_rows(logits)
    return logits.max(dim=-1).indices


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.repetition_penalty is not None and batch.seen_mask is not None:
        # Hugging Face's rule: shrink positive logits, push negative ones further down.
        penalty = batch.repetition_penalty[:, None].expand_as(logits)
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        # A penalty that rounds to 0 (or near it) in the logits' dtype would give inf and, times a
        # token masked to -inf, NaN. Clamped to +-1e6 (certainty already; finite after any
        # temperature), masked tokens kept masked.
        scaled = torch.where(torch.isneginf(logits), logits, scaled.nan_to_num(0.0).clamp(-1e6, 1e6))
        logits = torch.where(batch.seen_mask, scaled, logits)
    if batch.output_counts is not None:
        counts = batch.output_counts
        if batch.frequency_penalty is not None:
            logits = logits - batch.frequency_penalty[:, None] * counts
        if batch.presence_penalty is not None:
            logits = logits - batch.presence_penalty[:, None] * (counts > 0).to(logits.dtype)
    return logits


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (ties at the k-th value are kept too); a k of the
    vocabulary or more keeps every token. Only the limited rows are searched, for their largest k:
    a row without a limit would otherwise make it a full sort of every row."""
    vocab = logits.shape[-1]
    limited = top_k < vocab
    if not bool(limited.any()):
        return logits
    rows = limited.nonzero().squeeze(1)
    row_k = top_k[rows]
    values = logits[rows].topk(int(row_k.max()), dim=-1).values
    kth = torch.full((logits.shape[0], 1), float("-inf"), dtype=logits.dtype, device=logits.device)
    kth[rows] = values.gather(1, (row_k - 1).clamp(min=0)[:, None])  # the others keep everything
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
    drop_sorted = before >= top_p[:, None]
    drop_sorted[:, 0] = False  # always keep the most likely token
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the most likely token."""
    probs = logits.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))
