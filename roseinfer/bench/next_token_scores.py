"""How well next-token distributions predict a text, and how far they are from a reference's.

The statistics of llama.cpp's `llama-perplexity --kl-divergence`, computed from full
distributions: per scored position the negative log-likelihood of the actual next token, the KL
divergence KL(reference || candidate) of the whole distribution, and whether both rank the same
token first. Summaries: perplexity exp(mean NLL), mean KL divergence with its standard error, its
99th percentile (linear interpolation between sorted values, as llama.cpp does) and the share of
positions with the same top token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] logits of any dtype -> float32 log-probabilities."""
    return torch.log_softmax(logits.float(), dim=-1)


def kl_divergence(
    reference: torch.Tensor, candidate: torch.Tensor, floor: float | None = None
) -> torch.Tensor:
    """KL(reference || candidate) per row, from [rows, vocab] log-probabilities (in float64:
    the divergences of near-identical distributions are small differences of large sums).
    With `floor`, tokens whose reference log-probability is not above it are left out, as
    llama.cpp does with its stored reference (whose tail below e^-16 is clamped)."""
    ref = reference.double()
    terms = ref.exp() * (ref - candidate.double())
    if floor is not None:
        terms = torch.where(ref > floor, terms, torch.zeros_like(terms))
    return terms.sum(dim=-1)


@dataclass
class ScoreAccumulator:
    """Per-position scores of one candidate over all chunks, against an optional reference."""

    nll: list[np.ndarray] = field(default_factory=list)
    kld: list[np.ndarray] = field(default_factory=list)
    same_top: list[np.ndarray] = field(default_factory=list)

    def add(
        self,
        candidate: torch.Tensor,
        targets: torch.Tensor,
        reference: torch.Tensor | None = None,
        reference_floor: float | None = None,
    ) -> None:
        """candidate, reference: [rows, vocab] log-probabilities; targets: [rows] actual next
        tokens; reference_floor: see `kl_divergence`."""
        if candidate.shape[0] != targets.shape[0]:
            raise ValueError(f"{candidate.shape[0]} rows of log-probabilities for {targets.shape[0]} targets")
        picked = candidate.gather(1, targets.long()[:, None])[:, 0]
        self.nll.append((-picked.double()).cpu().numpy())
        if reference is not None:
            if reference.shape != candidate.shape:
                raise ValueError(f"reference {tuple(reference.shape)} and candidate {tuple(candidate.shape)} differ")
            self.kld.append(kl_divergence(reference, candidate, reference_floor).cpu().numpy())
            self.same_top.append((reference.argmax(dim=-1) == candidate.argmax(dim=-1)).cpu().numpy())

    def summary(self) -> QualitySummary:
        if not self.nll:
            raise ValueError("no positions were scored")
        nll = np.concatenate(self.nll)
        summary = QualitySummary(tokens=int(nll.size), perplexity=math.exp(float(nll.mean())))
        if self.kld:
            kld = np.concatenate(self.kld)
            summary.mean_kld = float(kld.mean())
            summary.mean_kld_stderr = float(kld.std(ddof=1) / math.sqrt(kld.size)) if kld.size > 1 else 0.0
            summary.kld_p99 = float(np.percentile(kld, 99.0))
            summary.same_top = float(np.concatenate(self.same_top).mean())
        return summary


@dataclass
class QualitySummary:
    tokens: int  # scored positions
    perplexity: float
    mean_kld: float | None = None
    mean_kld_stderr: float | None = None
    kld_p99: float | None = None
    same_top: float | None = None  # fraction of positions whose most likely token is the reference's
