"""Runs scheduled steps on the model: keeps each request's state from the scheduler's messages,
lays the step out as one flattened batch, runs the model and samples.

The batch has no padding: decode tokens first (one per request), then prefill chunks. For every
token: its id, its position and its slot in the KV pool; for every request: its block table.
Logits are computed only for the last token of requests that are caught up, which get a sample.
The runner learns everything from `SchedulerOutput`s (plain data), so a runner in another process
works from the same messages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from roseinfer.config import EngineConfig, ModelConfig
from roseinfer.core.messages import ModelRunnerOutput, NewRequestData, SchedulerOutput
from roseinfer.errors import InvalidRequestError
from roseinfer.layers.attention import (
    AttentionMetadata,
    DecodeKernel,
    PrefillChunk,
    causal_mask_with_prefix,
)
from roseinfer.layers.cpu_kernels import cpu_kernels
from roseinfer.outputs import TokenLogprob
from roseinfer.sampling_params import SamplingParams
from roseinfer.step_timings import PhaseClock, StepTimings
from roseinfer.worker.fault_injection import fault_token_from_env, raise_if_faulty
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


class CachedRequestState:
    """What the runner keeps of a request between steps."""

    __slots__ = ("req_id", "token_ids", "num_prompt_tokens", "sampling_params", "eos_token_ids", "block_ids",
                 "num_computed_tokens", "generator")

    def __init__(self, new: NewRequestData) -> None:
        self.req_id = new.req_id
        self.token_ids = list(new.prompt_token_ids) + list(new.output_token_ids)
        self.num_prompt_tokens = len(new.prompt_token_ids)
        self.sampling_params: SamplingParams = new.sampling_params
        self.eos_token_ids = new.eos_token_ids
        self.block_ids = list(new.block_ids)
        self.num_computed_tokens = new.num_computed_tokens
        self.generator: torch.Generator | None = None  # seeded sampling, made on first use

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states that are sampled
    sampling: list[CachedRequestState]  # the requests those rows belong to


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        config: EngineConfig,
        timings: StepTimings | None = None,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.block_size = config.block_size
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.vocab_size = model_config.vocab_size
        self.timings = timings or StepTimings()
        # One pool per layer: [2 (K, V), blocks, block_size, kv_heads, head_dim]. Zeroed, because
        # padded attention reads unused slots and NaN garbage there would leak through the mask.
        shape = (2, config.num_kv_blocks, self.block_size, model_config.num_kv_heads, model_config.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(model_config.num_layers)
        ]
        self.sampler = Sampler()
        self.decode_kernel = decode_kernel_for(config.attention_backend, self.device)
        self.requests: dict[str, CachedRequestState] = {}
        self.fault_token_id = fault_token_from_env()  # tests only (see fault_injection.py)

    # -- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        clock = PhaseClock(self.timings)
        inputs = self.prepare_inputs(scheduler_output)
        clock.lap("prepare")
        if self.fault_token_id is not None:
            raise_if_faulty(self.fault_token_id, [
                (state := self.requests[req_id]).token_ids[: state.num_prompt_tokens]
                for req_id in scheduler_output.num_scheduled_tokens
            ])
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if not inputs.sampling:
            clock.lap("forward")
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
        clock.lap("forward")
        output = self.sample(logits, inputs.sampling)
        clock.lap("sample")
        return output

    @torch.inference_mode()
    def compute_logits(self, scheduler_output: SchedulerOutput) -> tuple[torch.Tensor, list[str]]:
        """Run a step and return the raw logits of its sampled rows and their request ids (for
        tests and debugging; nothing is sampled)."""
        inputs = self.prepare_inputs(scheduler_output)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
        return logits, [state.req_id for state in inputs.sampling]

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply what the scheduler says changed: finished requests, new ones, new tokens and blocks."""
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            state = CachedRequestState(new)
            known = self.requests.get(new.req_id)
            if known is not None:  # sent again (the engine core replays a failed step): same random stream
                state.generator = known.generator
            self.requests[new.req_id] = state
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.token_ids.extend(cached.new_token_ids)
            if cached.block_ids is not None:
                state.block_ids = cached.block_ids
            state.num_computed_tokens = cached.num_computed_tokens
        if scheduler_output.blocks_to_copy:
            self._copy_blocks(scheduler_output.blocks_to_copy)

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        self.update_states(scheduler_output)
        block_size = self.block_size
        scheduled = [
            (self.requests[req_id], num_new) for req_id, num_new in scheduler_output.num_scheduled_tokens.items()
        ]
        decodes = [(state, n) for state, n in scheduled if n == 1]
        prefills = [(state, n) for state, n in scheduled if n > 1]
        ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        logits_indices: list[int] = []
        sampling: list[CachedRequestState] = []

        for state, num_new in decodes + prefills:
            start = state.num_computed_tokens
            end = start + num_new
            ids.extend(state.token_ids[start:end])
            pos = np.arange(start, end, dtype=np.int64)
            table = np.asarray(state.block_ids, dtype=np.int64)
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            if end == len(state.token_ids):  # caught up: its last position gives the next token
                logits_indices.append(len(ids) - 1)
                sampling.append(state)

        meta = AttentionMetadata(slot_mapping=self._tensor(np.concatenate(slots)))
        if decodes:
            self._decode_metadata(meta, [state for state, _ in decodes])
        offset = len(decodes)
        for state, num_new in prefills:
            cached = state.num_computed_tokens
            num_blocks = -(-(cached + num_new) // block_size)
            block_ids = self._tensor(np.asarray(state.block_ids[:num_blocks], dtype=np.int64))
            mask = causal_mask_with_prefix(cached, num_new, self.device) if cached else None
            meta.prefills.append(PrefillChunk(offset, num_new, cached, block_ids, mask))
            offset += num_new

        return StepInputs(
            input_ids=self._tensor(np.asarray(ids, dtype=np.int64)),
            positions=self._tensor(np.concatenate(positions)),
            meta=meta,
            logits_indices=self._tensor(np.asarray(logits_indices, dtype=np.int64)),
            sampling=sampling,
        )

    def _decode_metadata(self, meta: AttentionMetadata, states: list[CachedRequestState]) -> None:
        lengths = np.fromiter((s.num_computed_tokens + 1 for s in states), np.int64, len(states))
        max_blocks = int(-(-lengths.max() // self.block_size))
        # Padded with block 0: a real block, so the padding holds finite values the mask hides.
        padded = np.zeros((len(states), max_blocks), dtype=np.int64)
        for row, state in enumerate(states):
            table = state.block_ids[:max_blocks]
            padded[row, : len(table)] = table
        meta.num_decode_tokens = len(states)
        meta.decode_block_tables = self._tensor(padded)
        meta.decode_context_lens = self._tensor(lengths)
        meta.decode_kernel = self.decode_kernel
        if self.decode_kernel is None:
            key_positions = np.arange(max_blocks * self.block_size)
            mask = key_positions[None, :] < lengths[:, None]
            meta.decode_mask = self._tensor(mask[:, None, None, :])

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]

    # -- sampling -------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, states: list[CachedRequestState]) -> ModelRunnerOutput:
        batch = self._sampling_batch(states)
        out = self.sampler(logits, batch)
        token_ids = out.token_ids.tolist()
        logprobs = None
        if out.logprobs is not None:
            chosen = out.logprobs.tolist()
            top_ids = out.top_ids.tolist() if out.top_ids is not None else None
            top_values = out.top_logprobs.tolist() if out.top_logprobs is not None else None
            logprobs = []
            for row, state in enumerate(states):
                wanted = state.sampling_params.logprobs
                top = []
                if wanted and top_ids is not None:
                    top = list(zip(top_ids[row][:wanted], top_values[row][:wanted], strict=True))
                logprobs.append([TokenLogprob(token_ids[row], chosen[row], top)])
        return ModelRunnerOutput([s.req_id for s in states], [[t] for t in token_ids], logprobs)

    def _sampling_batch(self, states: list[CachedRequestState]) -> SamplingBatch:
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
                    batch.generators[row] = self._generator(state)
        if any(p.uses_penalties for p in params):
            self._penalty_inputs(batch, states)
        for row, state in enumerate(states):
            p = state.sampling_params
            if state.num_output_tokens < p.min_tokens:
                batch.banned.append((row, sorted(set(p.stop_token_ids) | set(state.eos_token_ids))))
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        if wanted:
            batch.max_logprobs = max(wanted)
        return batch

    def _penalty_inputs(self, batch: SamplingBatch, states: list[CachedRequestState]) -> None:
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

    def _generator(self, state: CachedRequestState) -> torch.Generator:
        if state.generator is None:
            state.generator = torch.Generator(device=self.device)
            state.generator.manual_seed(state.sampling_params.seed)
        return state.generator
