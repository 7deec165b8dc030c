"""Turns a scheduled step into tensors, runs the model on one flattened batch and samples.

The batch has no padding: decode tokens first (one per request), then prefill chunks. For every
token: its id, its position and its slot in the KV pool; for every request: its block table.
Logits are computed only for the last token of requests that are caught up and need a sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from roseinfer.config import ModelConfig
from roseinfer.core.kv_cache_manager import BlockCopy, KVCacheManager
from roseinfer.core.scheduler import SchedulerOutput
from roseinfer.errors import InvalidRequestError
from roseinfer.layers.attention import (
    AttentionMetadata,
    DecodeKernel,
    PrefillChunk,
    causal_mask_with_prefix,
)
from roseinfer.layers.cpu_kernels import cpu_kernels
from roseinfer.outputs import TokenLogprob
from roseinfer.request import Request
from roseinfer.step_timings import PhaseClock, StepTimings
from roseinfer.worker.sampler import Sampler, SamplingBatch


def decode_kernel_for(attention_backend: str, device: torch.device) -> DecodeKernel | None:
    """The compiled decode kernel for `cpp` (and for `auto` on the CPU when it builds)."""
    if attention_backend == "torch" or (attention_backend == "auto" and device.type != "cpu"):
        return None
    if device.type != "cpu":
        raise InvalidRequestError(f"attention_backend 'cpp' runs on the CPU only, not {device}", "attention_backend")
    kernels = cpu_kernels()
    if kernels is None and attention_backend == "cpp":
        raise InvalidRequestError("attention_backend 'cpp': the C++ kernel could not be built", "attention_backend")
    return kernels.paged_decode_attention if kernels is not None else None


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values."""
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


@dataclass
class ModelRunnerOutput:
    """Samples for the requests that got one this step, in the order of `requests`."""

    requests: list[Request]
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states that are sampled
    sampling_requests: list[Request]


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        kv_cache: KVCacheManager,
        device: torch.device,
        dtype: torch.dtype,
        attention_backend: str = "auto",
    ) -> None:
        self.model = model
        self.config = config
        self.kv_cache_manager = kv_cache
        self.block_size = kv_cache.block_size
        self.device = device
        self.dtype = dtype
        self.vocab_size = config.vocab_size
        # One pool per layer: [2 (K, V), blocks, block_size, kv_heads, head_dim]. Zeroed, because
        # padded attention reads unused slots and NaN garbage there would leak through the mask.
        shape = (2, kv_cache.num_blocks, self.block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)
        ]
        self.sampler = Sampler()
        self.decode_kernel = decode_kernel_for(attention_backend, device)
        self._generators: dict[int, torch.Generator] = {}

    # -- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, step: SchedulerOutput, clock: PhaseClock | None = None) -> ModelRunnerOutput:
        clock = clock or PhaseClock(StepTimings())
        if step.blocks_to_copy:
            self._copy_blocks(step.blocks_to_copy)
        inputs = self.prepare_inputs(step)
        clock.lap("prepare")
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if not inputs.sampling_requests:
            clock.lap("forward")
            return ModelRunnerOutput([], [])
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
        clock.lap("forward")
        output = self.sample(logits, inputs.sampling_requests)
        clock.lap("sample")
        return output

    @torch.inference_mode()
    def compute_logits_for(self, step: SchedulerOutput) -> tuple[torch.Tensor, list[Request]]:
        """Run a step and return the raw logits of its sampled rows (for tests and debugging)."""
        inputs = self.prepare_inputs(step)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        return self.model.compute_logits(hidden.index_select(0, inputs.logits_indices)), inputs.sampling_requests

    def prepare_inputs(self, step: SchedulerOutput) -> StepInputs:
        block_size = self.block_size
        decodes = [(r, n) for r, n in zip(step.requests, step.num_new_tokens, strict=True) if n == 1]
        prefills = [(r, n) for r, n in zip(step.requests, step.num_new_tokens, strict=True) if n > 1]
        ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        logits_indices: list[int] = []
        sampling: list[Request] = []
        tables = self.kv_cache_manager.block_tables

        for request, num_new in decodes + prefills:
            start = request.num_computed_tokens
            end = start + num_new
            ids.extend(request.token_ids[start:end])
            pos = np.arange(start, end, dtype=np.int64)
            table = np.asarray(tables[request.request_id], dtype=np.int64)
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            if end == request.num_tokens:
                logits_indices.append(len(ids) - 1)
                sampling.append(request)

        meta = AttentionMetadata(slot_mapping=self._tensor(np.concatenate(slots)))
        if decodes:
            self._decode_metadata(meta, [r for r, _ in decodes])
        offset = len(decodes)
        for request, num_new in prefills:
            cached = request.num_computed_tokens
            num_blocks = -(-(cached + num_new) // block_size)
            block_ids = self._tensor(np.asarray(tables[request.request_id][:num_blocks], dtype=np.int64))
            mask = causal_mask_with_prefix(cached, num_new, self.device) if cached else None
            meta.prefills.append(PrefillChunk(offset, num_new, cached, block_ids, mask))
            offset += num_new

        return StepInputs(
            input_ids=self._tensor(np.asarray(ids, dtype=np.int64)),
            positions=self._tensor(np.concatenate(positions)),
            meta=meta,
            logits_indices=self._tensor(np.asarray(logits_indices, dtype=np.int64)),
            sampling_requests=sampling,
        )

    def _decode_metadata(self, meta: AttentionMetadata, requests: list[Request]) -> None:
        tables = self.kv_cache_manager.block_tables
        lengths = np.fromiter((r.num_computed_tokens + 1 for r in requests), np.int64, len(requests))
        max_blocks = int(-(-lengths.max() // self.block_size))
        # Padded with block 0: a real block, so the padding holds finite values the mask hides.
        padded = np.zeros((len(requests), max_blocks), dtype=np.int64)
        for row, request in enumerate(requests):
            table = tables[request.request_id][:max_blocks]
            padded[row, : len(table)] = table
        meta.num_decode_tokens = len(requests)
        meta.decode_block_tables = self._tensor(padded)
        meta.decode_context_lens = self._tensor(lengths)
        meta.decode_kernel = self.decode_kernel
        if self.decode_kernel is None:
            key_positions = np.arange(max_blocks * self.block_size)
            mask = key_positions[None, :] < lengths[:, None]
            meta.decode_mask = self._tensor(mask[:, None, None, :])

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def _copy_blocks(self, copies: list[BlockCopy]) -> None:
        src = torch.tensor([c.src for c in copies], device=self.device)
        dst = torch.tensor([c.dst for c in copies], device=self.device)
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]

    # -- sampling -------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, requests: list[Request]) -> ModelRunnerOutput:
        batch = self._sampling_batch(requests)
        out = self.sampler(logits, batch)
        token_ids = out.token_ids.tolist()
        logprobs = None
        if out.logprobs is not None:
            chosen = out.logprobs.tolist()
            top_ids = out.top_ids.tolist() if out.top_ids is not None else None
            top_values = out.top_logprobs.tolist() if out.top_logprobs is not None else None
            logprobs = []
            for row, request in enumerate(requests):
                wanted = request.sampling_params.logprobs
                top = []
                if wanted and top_ids is not None:
                    top = list(zip(top_ids[row][:wanted], top_values[row][:wanted], strict=True))
                logprobs.append(TokenLogprob(token_ids[row], chosen[row], top))
        return ModelRunnerOutput(requests, token_ids, logprobs)

    def _sampling_batch(self, requests: list[Request]) -> SamplingBatch:
        params = [r.sampling_params for r in requests]
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
            for row, (request, p) in enumerate(zip(requests, params, strict=True)):
                if p.seed is not None and not p.greedy:
                    batch.generators[row] = self._generator(request)
        if any(p.uses_penalties for p in params):
            self._penalty_inputs(batch, requests)
        for row, request in enumerate(requests):
            p = request.sampling_params
            if request.num_output_tokens < p.min_tokens:
                batch.banned.append((row, sorted(set(p.stop_token_ids) | request.eos_token_ids)))
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        if wanted:
            batch.max_logprobs = max(wanted)
        return batch

    def _penalty_inputs(self, batch: SamplingBatch, requests: list[Request]) -> None:
        device, vocab = self.device, self.vocab_size
        params = [r.sampling_params for r in requests]
        rows = len(requests)

        def padded(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
            width = max((len(x) for x in lists), default=0) or 1
            ids = np.zeros((rows, width), dtype=np.int64)
            valid = np.zeros((rows, width), dtype=np.float32)
            for row, x in enumerate(lists):
                ids[row, : len(x)] = x
                valid[row, : len(x)] = 1.0
            return self._tensor(ids), self._tensor(valid)

        ids, valid = padded([r.output_token_ids for r in requests])
        counts = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        batch.output_counts = counts.scatter_add_(1, ids, valid)
        batch.frequency_penalty = torch.tensor([p.frequency_penalty for p in params], device=device)
        batch.presence_penalty = torch.tensor([p.presence_penalty for p in params], device=device)
        if any(p.repetition_penalty != 1.0 for p in params):
            ids, valid = padded([r.token_ids for r in requests])
            seen = torch.zeros(rows, vocab, dtype=torch.float32, device=device).scatter_add_(1, ids, valid)
            batch.seen_mask = seen > 0
            batch.repetition_penalty = torch.tensor(
                [p.repetition_penalty for p in params], dtype=torch.float32, device=device
            )

    def _generator(self, request: Request) -> torch.Generator:
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(request.sampling_params.seed)
            self._generators[request.request_id] = generator
        return generator

    def release(self, request_id: int) -> None:
        """Forget a finished request's per-request state (its seeded generator)."""
        self._generators.pop(request_id, None)
