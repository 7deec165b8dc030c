"""The sampling tensors of a batch of requests (worker/sampler.py's SamplingBatch): temperatures,
top-k/p, min-p, penalties with their token counts, min-tokens bans, logit bias (built once per
request), and each seeded request's own generator, kept with the request across steps."""

from __future__ import annotations

import numpy as np
import torch

from roseinfer.worker.request_state import CachedRequestState
from roseinfer.worker.sampler import SamplingBatch


class SamplingInputs:
    def __init__(self, device: torch.device, vocab_size: int) -> None:
        self.device = device
        self.vocab_size = vocab_size

    def batch(self, states: list[CachedRequestState]) -> SamplingBatch:
        """The sampling parameters of `states` (one row each) as tensors."""
        params = [s.sampling_params for s in states]
        device = self.device
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        batch = SamplingBatch(temperature=temperature, all_greedy=all(p.greedy for p in params))
        if not batch.all_greedy:
            if any(p.top_k > 0 for p in params):
                batch.top_k = torch.tensor(
                    [p.top_k if p.top_k > 0 else self.vocab_size for p in params], device=device
                )
            if any(p.top_p < 1.0 for p in params):
                batch.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
            if any(p.min_p > 0.0 for p in params):
                batch.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
            for row, (state, p) in enumerate(zip(states, params, strict=True)):
                if p.seed is not None and not p.greedy:
                    batch.generators[row] = self.generator(state)
        if any(p.uses_penalties for p in params):
            self._penalties(batch, states)
        for row, state in enumerate(states):
            p = state.sampling_params
            if state.num_output_tokens < p.min_tokens:
                batch.banned.append((row, sorted(set(p.stop_token_ids) | set(state.eos_token_ids))))
        if any(p.logit_bias for p in params):
            rows, tokens, biases = [], [], []
            for row, state in enumerate(states):
                if not state.sampling_params.logit_bias:
                    continue
                if state.logit_bias is None:
                    bias = state.sampling_params.logit_bias
                    state.logit_bias = (self._tensor(np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))),
                                        self._tensor(np.fromiter(bias.values(), dtype=np.float32, count=len(bias))))
                ids, values = state.logit_bias
                rows.append(torch.full_like(ids, row))
                tokens.append(ids)
                biases.append(values)
            batch.logit_bias = (torch.cat(rows), torch.cat(tokens), torch.cat(biases))
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        if wanted:
            batch.max_logprobs = max(wanted)
        return batch

    def _penalties(self, batch: SamplingBatch, states: list[CachedRequestState]) -> None:
        device, vocab = self.device, self.vocab_size
        params = [s.sampling_params for s in states]
        rows = len(states)

        def padded(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
            width = max((len(x) for x in lists), default=0) or 1
            ids = np.zeros((rows, width), dtype=np.int64)
            valid = np.zeros((rows, width), dtype=np.float32)
            for row, x in enumerate(lists):
                ids[row, : len(x)] = x
                valid[row, : len(x)] = 1.0
            return self._tensor(ids), self._tensor(valid)

        ids, valid = padded([s.output_token_ids for s in states])
        counts = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        batch.output_counts = counts.scatter_add_(1, ids, valid)
        batch.frequency_penalty = torch.tensor([p.frequency_penalty for p in params], device=device)
        batch.presence_penalty = torch.tensor([p.presence_penalty for p in params], device=device)
        if any(p.repetition_penalty != 1.0 for p in params):
            ids, valid = padded([s.token_ids for s in states])
            seen = torch.zeros(rows, vocab, dtype=torch.float32, device=device).scatter_add_(1, ids, valid)
            batch.seen_mask = seen > 0
            batch.repetition_penalty = torch.tensor(
                [p.repetition_penalty for p in params], dtype=torch.float32, device=device
            )

    def generator(self, state: CachedRequestState) -> torch.Generator:
        if state.generator is None:
            state.generator = torch.Generator(device=self.device)
            state.generator.manual_seed(state.sampling_params.seed)
        return state.generator

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)
