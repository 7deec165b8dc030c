"""Runs scheduled steps on the model: keeps each request's state from the scheduler's messages,
lays the step out as one flattened batch, runs the model and samples.

The batch has no padding: decode tokens first (one per request), then prefill chunks. For every
token: its id, its position and its slot in the KV pool; for every request: its block table.
Logits are computed only for the last token of requests that are caught up, which get a sample.
Pooling requests (embeddings) get no logits and no sample: their rows of the final-norm hidden
states are pooled instead (the last prompt token's row, or the mean over every chunk's rows).
The runner learns everything from `SchedulerOutput`s (plain data), so a runner in another process
works from the same messages.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from roseinfer.common.kv_cache_spec import group_pool_sizes, layer_groups, model_kv_cache_groups
from roseinfer.common.messages import ModelRunnerOutput, NewRequestData, SchedulerOutput
from roseinfer.config import EngineConfig, ModelConfig
from roseinfer.distributed.parallel_state import get_tp_group
from roseinfer.distributed.partition import partition
from roseinfer.heap import trim_heap
from roseinfer.layers.attention import AttentionMetadata
from roseinfer.layers.attention_backends import (
    AttentionBatch,
    PrefillRows,
    select_attention_backend,
)
from roseinfer.layers.recurrent import recurrent_state_spec
from roseinfer.models.fused_decode import fused_decoder_for
from roseinfer.models.loader import load_vision_encoder
from roseinfer.outputs import TokenLogprob
from roseinfer.pooling_params import PoolingParams
from roseinfer.sampling_params import SamplingParams
from roseinfer.step_timings import PhaseClock, StepTimings
from roseinfer.worker.fault_injection import fault_token_from_env, raise_if_faulty
from roseinfer.worker.image_embedder import ImageEmbedder, StepImageRows
from roseinfer.worker.sampler import Sampler, SamplingBatch
from roseinfer.worker.spec_decode import verify_drafts
from roseinfer.worker.state_pools import StatePools


def zeroed_untouched(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose memory is only committed where it is written (the KV pool: padded
    attention reads unused slots, so they must hold zeros, not NaN garbage). On the CPU it is an
    anonymous mapping: its pages are zero without being touched, so a large pool costs nothing
    until used (torch.zeros would write every page at start).

    In 4 KiB pages, not huge ones: a block of one layer's keys is a few KiB (6 KiB for the
    default model), and with 2 MiB pages (numpy asks for them on large arrays) the first block
    written in each layer's K and V halves commits 2 MiB: +100 MiB of peak RSS over the shared
    64-request workload in bfloat16 KV."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    pages = mmap.mmap(-1, max(count * dtype.itemsize, 1), flags=mmap.MAP_PRIVATE)  # anonymous, not shared
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux; elsewhere no huge pages unless asked for
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)  # keeps `pages` alive


class CachedRequestState:
    """What the runner keeps of a request between steps."""

    __slots__ = ("req_id", "token_ids", "num_prompt_tokens", "sampling_params", "eos_token_ids", "block_ids",
                 "num_computed_tokens", "generator", "logit_bias", "pooling_params", "pool_sum", "pool_count",
                 "pool_before_last", "images")

    def __init__(self, new: NewRequestData) -> None:
        self.req_id = new.req_id
        self.token_ids = list(new.prompt_token_ids) + list(new.output_token_ids)
        self.num_prompt_tokens = len(new.prompt_token_ids)
        self.sampling_params: SamplingParams | None = new.sampling_params
        self.pooling_params: PoolingParams | None = new.pooling_params
        # Mean pooling over a prompt run in chunks: the sum of the rows so far and how many.
        self.pool_sum: torch.Tensor | None = None
        self.pool_count = 0
        self.pool_before_last: tuple[torch.Tensor | None, int] = (None, 0)  # to run the last chunk again
        self.eos_token_ids = new.eos_token_ids
        self.block_ids = list(new.block_ids)
        self.num_computed_tokens = new.num_computed_tokens
        self.images = new.images  # a vision-language prompt's images (their placeholder runs)
        self.generator: torch.Generator | None = None  # seeded sampling, made on first use
        # (token ids, biases) on the device, built on first use: not again at every step.
        self.logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None

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
    pooling: list[PoolingRows]  # the pooling requests' rows of the hidden states
    image_rows: StepImageRows | None = None  # image placeholders this step computes, and their rows


@dataclass
class PoolingRows:
    state: CachedRequestState
    first_row: int  # of this step's hidden states
    num_rows: int
    first_position: int  # of the request's prompt
    last_chunk: bool  # the prompt's last token is among them: the vector is complete


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
        # One pool per layer: [2 (K, V), blocks, block_size, kv_heads, head_dim], with only this
        # rank's KV heads under tensor parallelism. With several KV cache groups (Gemma's full and
        # sliding layers, common/kv_cache_spec.py) a layer's pool has its group's blocks; a
        # recurrent layer's "pool" is its state tensors, a slot per sequence (state_pools.py). Each
        # request has a block table per group.
        tp = get_tp_group()
        kv_heads = partition(model_config.num_kv_heads, tp.size, tp.rank)[1]
        row = model_config.kv_row_elements(config.kv_cache_torch_dtype)  # head_dim, or q8_0's codes and scales
        self.groups = model_kv_cache_groups(model_config)
        self.paged_groups = [index for index, group in enumerate(self.groups) if group.paged]
        self.group_windows = [self.groups[index].window for index in self.paged_groups]
        self.layer_groups = layer_groups(self.groups, model_config.num_layers)
        self.group_num_blocks = group_pool_sizes(self.groups, config.num_kv_blocks, config.num_kv_blocks_sliding,
                                                 config.max_num_seqs)
        self.recurrent_group: int | None = next((i for i, g in enumerate(self.groups) if not g.paged), None)
        self.state_pools: StatePools | None = None
        if self.recurrent_group is not None:
            rec = model_config.recurrent
            self.state_pools = StatePools(recurrent_state_spec(rec.kind, rec.params, rec.layers),
                                          self.group_num_blocks[self.recurrent_group], self.dtype, self.device,
                                          zeroed_untouched)
        self.kv_caches = [
            self.state_pools.pools[layer] if self.state_pools is not None and layer in self.state_pools.pools
            else zeroed_untouched((2, self.group_num_blocks[group], self.block_size, kv_heads, row),
                                  config.kv_cache_torch_dtype, self.device)
            for layer, group in enumerate(self.layer_groups)
        ]
        self.sampler = Sampler()
        # The engine's one attention backend (--attention-backend, the device, whether the C++
        # kernels built): it builds each step's metadata, which carries it to every layer.
        self.attention_backend = select_attention_backend(config.attention_backend, self.device, self.block_size)
        # Decode-only steps in one C++ call, where the model describes a step it computes (fused_decode.py).
        self.fused_decoder = (
            fused_decoder_for(model, self.dtype, self.device)
            if self.attention_backend.runs_fused_decode else None
        )
        self.long_rope_from = model_config.long_rope_from  # LongRoPE models: see prepare_inputs
        # A vision-language model's encoder, run for the image placeholders a step computes.
        self.image_embedder = (
            ImageEmbedder(load_vision_encoder(config, model_config), self.device, self.dtype)
            if model_config.vision is not None else None
        )
        self.requests: dict[str, CachedRequestState] = {}
        self.fault_token_id = fault_token_from_env()  # tests only (see fault_injection.py)

    # -- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if scheduler_output.empty:  # nothing to run; only forget the finished requests
            self.update_states(scheduler_output)
            return ModelRunnerOutput()
        clock = PhaseClock(self.timings)
        inputs = self.prepare_inputs(scheduler_output)
        clock.lap("prepare")
        if self.fault_token_id is not None:
            raise_if_faulty(self.fault_token_id, [
                (state := self.requests[req_id]).token_ids[: state.num_prompt_tokens]
                for req_id in scheduler_output.num_scheduled_tokens
            ])
        meta = inputs.meta
        pooled: dict[str, np.ndarray] = {}
        if self.fused_decoder is not None and not meta.prefills and not inputs.pooling:
            # Every request decodes one token and samples it: the rows are the batch itself.
            groups = list(meta.groups.values()) or [meta]
            logits = self.fused_decoder.forward(
                inputs.input_ids, inputs.positions, [g.slot_mapping for g in groups],
                [g.decode_block_tables for g in groups], meta.decode_context_lens, self.kv_caches, meta.long_rope,
            )
        else:
            if inputs.image_rows is not None:  # the placeholders' rows from the encoder, the rest looked up
                embeds = self.model.embed_input_ids(inputs.input_ids)
                embeds[inputs.image_rows.batch_rows] = inputs.image_rows.embeddings.to(embeds.dtype)
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta, inputs_embeds=embeds)
            else:
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta)
            pooled = self._pool(hidden, inputs.pooling)  # before lm_head, which pooling rows skip
            if not inputs.sampling:
                clock.lap("forward")
                return ModelRunnerOutput(pooled=pooled)
            logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
        clock.lap("forward")
        if logits is None:  # a tensor-parallel rank other than the first: rank 0 samples
            return ModelRunnerOutput()
        output = self.sample(logits, inputs.sampling, scheduler_output)
        output.pooled = pooled
        clock.lap("sample")
        if meta.prefills and self.device.type == "cpu":
            # A prefill chunk's activations (tens of MiB) are freed into the heap, where decode
            # steps' smaller buffers would keep them resident: return their pages now.
            trim_heap()
        return output

    @torch.inference_mode()
    def compute_logits(self, scheduler_output: SchedulerOutput) -> tuple[torch.Tensor | None, list[str]]:
        """Run a step and return the raw logits of its sampled rows and their request ids (for
        tests and debugging; nothing is sampled). Under tensor parallelism only rank 0 gets them."""
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
                state.generator = known.generator  # and the same mean-pooling sums
                state.pool_sum, state.pool_count, state.pool_before_last = (
                    known.pool_sum, known.pool_count, known.pool_before_last)
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
        long_rope: list[np.ndarray] = []
        slots: list[list[np.ndarray]] = [[] for _ in self.groups]  # per KV cache group (paged ones)
        logits_indices: list[int] = []
        sampling: list[CachedRequestState] = []
        pooling: list[PoolingRows] = []
        image_parts: list = []
        spec = scheduler_output.scheduled_spec_decode_tokens

        for state, num_new in decodes + prefills:
            drafts = spec.get(state.req_id, ())
            start = state.num_computed_tokens
            end = start + num_new - len(drafts)
            first_row = len(ids)
            ids.extend(state.token_ids[start:end])
            ids.extend(drafts)
            if state.images and start < state.num_prompt_tokens:
                image_parts += self.image_embedder.chunk_rows(state.images, state.token_ids, start, end, first_row)
            pos = np.arange(start, start + num_new, dtype=np.int64)
            positions.append(pos)
            if self.long_rope_from is not None:  # as layers/rotary.long_rope decides
                long_rope.append(np.maximum(pos + 1, state.num_prompt_tokens) > self.long_rope_from)
            for group in self.paged_groups:
                table = np.asarray(state.block_ids[group], dtype=np.int64)
                slots[group].append(table[pos // block_size] * block_size + pos % block_size)
            if state.pooling_params is not None:  # pooled, never sampled
                pooling.append(PoolingRows(state, first_row, num_new, start, end == len(state.token_ids)))
            elif end == len(state.token_ids):  # caught up: its last position gives the next token
                # (and with drafts, each draft's position too: they are verified)
                logits_indices.extend(range(len(ids) - 1 - len(drafts), len(ids)))
                sampling.append(state)

        metas = []
        for group in self.paged_groups:
            batch = AttentionBatch(slot_mapping=np.concatenate(slots[group]))
            if decodes:
                batch.decode_block_tables, batch.decode_context_lens = self._decode_tables(
                    [state for state, _ in decodes], group)
            offset = len(decodes)
            prefill_rows = []
            for state, num_new in prefills:
                num_blocks = -(-(state.num_computed_tokens + num_new) // block_size)
                block_ids = np.asarray(state.block_ids[group][:num_blocks], dtype=np.int64)
                prefill_rows.append(PrefillRows(offset, num_new, state.num_computed_tokens, block_ids))
                offset += num_new
            batch.prefills = prefill_rows
            metas.append(self.attention_backend.build_metadata(batch))
        meta = metas[0]
        if len(metas) > 1:  # each layer reads through its group's (AttentionMetadata.for_layer)
            meta.groups = dict(zip(self.group_windows, metas, strict=True))
        if long_rope:
            long_rope_rows = self._tensor(np.concatenate(long_rope))
            for group_meta in metas:
                group_meta.long_rope = long_rope_rows
        if self.state_pools is not None:  # each sequence's state slot, in batch order
            in_order = [state for state, _ in decodes + prefills]
            state_slots = [state.block_ids[self.recurrent_group][0] for state in in_order]
            self.state_pools.zero([slot for slot, state in zip(state_slots, in_order, strict=True)
                                   if state.num_computed_tokens == 0])
            for group_meta in metas:
                group_meta.state_slots = self._tensor(np.asarray(state_slots, dtype=np.int64))

        return StepInputs(
            input_ids=self._tensor(np.asarray(ids, dtype=np.int64)),
            positions=self._tensor(np.concatenate(positions)),
            meta=meta,
            logits_indices=self._tensor(np.asarray(logits_indices, dtype=np.int64)),
            sampling=sampling,
            pooling=pooling,
            image_rows=ImageEmbedder.gather(image_parts, self.device),
        )

    @staticmethod
    def _pool(hidden: torch.Tensor, entries: list[PoolingRows]) -> dict[str, np.ndarray]:
        """The pooled vectors (float32) of the pooling requests whose prompt ends this step; mean
        pooling adds up each chunk's rows as they come."""
        pooled: dict[str, np.ndarray] = {}
        for entry in entries:
            state = entry.state
            rows = hidden[entry.first_row : entry.first_row + entry.num_rows]
            if state.pooling_params.pooling_type == "mean":
                if entry.first_position == 0:  # (again) from the start: a preempted request is recomputed
                    state.pool_sum, state.pool_count = None, 0
                elif entry.first_position == state.pool_before_last[1]:  # a replayed step runs its chunk again
                    state.pool_sum, state.pool_count = state.pool_before_last
                if entry.first_position != state.pool_count:
                    raise RuntimeError(f"mean pooling of request {state.req_id!r}: a chunk starts at "
                                       f"{entry.first_position}, but {state.pool_count} rows were summed")
                state.pool_before_last = (state.pool_sum, state.pool_count)
                chunk = rows.float().sum(dim=0)
                state.pool_sum = chunk if state.pool_sum is None else state.pool_sum + chunk
                state.pool_count += entry.num_rows
                if entry.last_chunk:
                    pooled[state.req_id] = (state.pool_sum / state.pool_count).cpu().numpy()
            elif entry.last_chunk:  # last
                pooled[state.req_id] = rows[-1].float().cpu().numpy()
        return pooled

    def _decode_tables(self, states: list[CachedRequestState], group: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The decode rows' block tables (of KV cache group `group`), padded to the longest, and
        context lengths."""
        lengths = np.fromiter((s.num_computed_tokens + 1 for s in states), np.int64, len(states))
        max_blocks = int(-(-lengths.max() // self.block_size))
        # Padded with block 0: a real block, so the padding holds finite values the mask hides.
        padded = np.zeros((len(states), max_blocks), dtype=np.int64)
        for row, state in enumerate(states):
            table = state.block_ids[group][:max_blocks]
            padded[row, : len(table)] = table
        return padded, lengths

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def _copy_blocks(self, copies: list[tuple[int, ...]]) -> None:
        """(src, dst) in the pools of KV cache group 0, (src, dst, group) in another group's."""
        for group in self.paged_groups:
            mine = [c for c in copies if (c[2] if len(c) > 2 else 0) == group]
            if not mine:
                continue
            src = torch.tensor([c[0] for c in mine], device=self.device)
            dst = torch.tensor([c[1] for c in mine], device=self.device)
            for cache, layer_group in zip(self.kv_caches, self.layer_groups, strict=True):
                if layer_group == group:
                    cache[:, dst] = cache[:, src]

    # -- sampling -------------------------------------------------------------------------
    def sample(
        self, logits: torch.Tensor, states: list[CachedRequestState], scheduler_output: SchedulerOutput
    ) -> ModelRunnerOutput:
        """One token per request from its logits row; a request with draft tokens has a row per
        position and gets its accepted drafts and one more token."""
        spec = scheduler_output.scheduled_spec_decode_tokens
        if not spec or not any(s.req_id in spec for s in states):
            return self._sample_rows(logits, states, scheduler_output)
        plain_rows, plain_states, verified = [], [], []
        row = 0
        for state in states:
            drafts = spec.get(state.req_id)
            if drafts:
                verified.append((state, drafts, row))
            else:
                plain_rows.append(row)
                plain_states.append(state)
            row += 1 + len(drafts or ())
        tokens = self._verify(logits, verified)
        plain = self._sample_rows(logits[plain_rows], plain_states, scheduler_output) if plain_states else None
        if plain is not None:
            tokens |= dict(zip(plain.req_ids, plain.sampled_token_ids, strict=True))
        logprobs = None
        if plain is not None and plain.logprobs is not None:  # drafts never go with logprobs
            by_id = dict(zip(plain.req_ids, plain.logprobs, strict=True))
            logprobs = [by_id.get(s.req_id, []) for s in states]
        return ModelRunnerOutput([s.req_id for s in states], [tokens[s.req_id] for s in states], logprobs)

    def _verify(
        self, logits: torch.Tensor, entries: list[tuple[CachedRequestState, list[int], int]]
    ) -> dict[str, list[int]]:
        rows = [r for _, drafts, start in entries for r in range(start, start + len(drafts) + 1)]
        expanded = [state for state, drafts, _ in entries for _ in range(len(drafts) + 1)]
        greedy, probs = self.sampler.probabilities(logits[rows], self._sampling_batch(expanded))
        tokens, offset = {}, 0
        for state, drafts, _ in entries:
            span = slice(offset, offset + len(drafts) + 1)
            params = state.sampling_params
            generator = self._generator(state) if params.seed is not None and not params.greedy else None
            tokens[state.req_id] = verify_drafts(
                drafts, greedy[span], None if params.greedy else probs[span], generator
            )
            offset += len(drafts) + 1
        return tokens

    def _sample_rows(
        self, logits: torch.Tensor, states: list[CachedRequestState], scheduler_output: SchedulerOutput
    ) -> ModelRunnerOutput:
        batch = self._sampling_batch(states)
        if scheduler_output.grammar_bitmask is not None:
            rows = scheduler_output.structured_output_request_ids
            pairs = [(row, rows[s.req_id]) for row, s in enumerate(states) if s.req_id in rows]
            batch.bitmask_rows = [logits_row for logits_row, _ in pairs]
            batch.bitmask = torch.from_numpy(scheduler_output.grammar_bitmask[[mask_row for _, mask_row in pairs]])
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
