"""Runs scheduled steps on the model: keeps each request's state from the scheduler's messages
(request_state.py), has the step's flattened batch built (input_batch.py), runs the model, and
samples (sampler.py over sampling_inputs.py's tensors; spec_decode.py verifies draft tokens) or
pools (pooling.py). It owns the per-sequence pools: a KV pool per attention layer, the recurrent
layers' state pools (state_pools.py), committed where written (kv_pools.py).

The runner learns everything from `SchedulerOutput`s (plain data), so a runner in another process
works from the same messages.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from roseinfer.common.kv_cache_spec import group_pool_sizes, layer_groups, model_kv_cache_groups
from roseinfer.common.messages import ModelRunnerOutput, SchedulerOutput
from roseinfer.config import EngineConfig, ModelConfig
from roseinfer.distributed.parallel_state import get_tp_group
from roseinfer.distributed.partition import partition
from roseinfer.heap import trim_heap
from roseinfer.layers.attention_backends import select_attention_backend
from roseinfer.layers.recurrent import recurrent_state_spec
from roseinfer.models.fused_decode import fused_decoder_for
from roseinfer.models.loader import load_vision_encoder
from roseinfer.outputs import TokenLogprob
from roseinfer.step_timings import PhaseClock, StepTimings
from roseinfer.worker.fault_injection import fault_token_from_env, raise_if_faulty
from roseinfer.worker.image_embedder import ImageEmbedder
from roseinfer.worker.input_batch import InputBatchBuilder, StepInputs
from roseinfer.worker.kv_pools import zeroed_untouched
from roseinfer.worker.pooling import pool_hidden_states
from roseinfer.worker.request_state import CachedRequestState
from roseinfer.worker.sampler import Sampler
from roseinfer.worker.sampling_inputs import SamplingInputs
from roseinfer.worker.spec_decode import verify_requests
from roseinfer.worker.state_pools import StatePools


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
            # The sequences' slots, then the prefix cache's snapshot slots (core/kv_cache/recurrent_state.py).
            num_slots = self.group_num_blocks[self.recurrent_group] + (
                config.num_state_snapshots or 0 if config.enable_prefix_caching else 0)
            self.state_pools = StatePools(recurrent_state_spec(rec.kind, rec.params, rec.layers), num_slots,
                                          self.dtype, self.device, zeroed_untouched)
        self.kv_caches: list[torch.Tensor] = []
        for layer, group in enumerate(self.layer_groups):
            if self.state_pools is not None and layer in self.state_pools.pools:
                self.kv_caches.append(self.state_pools.pools[layer])
            elif layer in model_config.kv_shared_layers:  # reads an earlier layer's pool (Gemma 4)
                self.kv_caches.append(self.kv_caches[model_config.kv_shared_layers[layer]])
            else:
                kv_heads, head_dim = model_config.layer_kv_shape(layer)
                kv_heads = partition(kv_heads, tp.size, tp.rank)[1]
                row = model_config.kv_row_elements(config.kv_cache_torch_dtype, head_dim)  # or q8_0's codes, scales
                self.kv_caches.append(zeroed_untouched((2, self.group_num_blocks[group], self.block_size, kv_heads,
                                                        row), config.kv_cache_torch_dtype, self.device))
        self.sampler = Sampler()
        self.sampling_inputs = SamplingInputs(self.device, self.vocab_size)
        # The engine's one attention backend (--attention-backend, the device, whether the C++
        # kernels built): it builds each step's metadata, which carries it to every layer.
        self.attention_backend = select_attention_backend(config.attention_backend, self.device, self.block_size)
        # A vision-language model's encoder, run for the image placeholders a step computes.
        self.image_embedder = (
            ImageEmbedder(load_vision_encoder(config, model_config), self.device, self.dtype)
            if model_config.vision is not None else None
        )
        self.input_batch = InputBatchBuilder(self.groups, self.block_size, self.attention_backend, self.device,
                                             model_config.long_rope_from, self.state_pools, self.image_embedder)
        # Decode-only steps in one C++ call, where the model describes a step it computes (fused_decode.py).
        self.fused_decoder = (
            fused_decoder_for(model, self.dtype, self.device)
            if self.attention_backend.runs_fused_decode else None
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
            self._save_states(scheduler_output)
        else:
            if inputs.image_rows is not None:  # the placeholders' rows from the encoder, the rest looked up
                embeds = self.model.embed_input_ids(inputs.input_ids)
                embeds[inputs.image_rows.batch_rows] = inputs.image_rows.embeddings.to(embeds.dtype)
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta, inputs_embeds=embeds)
            else:
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta)
            pooled = pool_hidden_states(hidden, inputs.pooling)  # before lm_head, which pooling rows skip
            self._save_states(scheduler_output)
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
        self._save_states(scheduler_output)
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
        scheduled = [
            (self.requests[req_id], num_new) for req_id, num_new in scheduler_output.num_scheduled_tokens.items()
        ]
        return self.input_batch.build(scheduled, scheduler_output.scheduled_spec_decode_tokens)

    def _copy_blocks(self, copies: list[tuple[int, ...]]) -> None:
        """(src, dst) in the pools of KV cache group 0, (src, dst, group) in another group's; in the
        recurrent group's, state slots (a prefix hit's snapshot into its sequence's slot)."""
        for group in self.paged_groups:
            mine = [c for c in copies if (c[2] if len(c) > 2 else 0) == group]
            if not mine:
                continue
            src = torch.tensor([c[0] for c in mine], device=self.device)
            dst = torch.tensor([c[1] for c in mine], device=self.device)
            for cache, layer_group in zip(self.kv_caches, self.layer_groups, strict=True):
                if layer_group == group:
                    cache[:, dst] = cache[:, src]
        states = [(c[0], c[1]) for c in copies if len(c) > 2 and c[2] == self.recurrent_group]
        if states:
            self.state_pools.copy(states)

    def _save_states(self, scheduler_output: SchedulerOutput) -> None:
        """The step's state snapshots, after its forward wrote the states they copy."""
        if scheduler_output.states_to_save:
            self.state_pools.copy(scheduler_output.states_to_save)

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
        tokens = verify_requests(logits, verified, self.sampler, self.sampling_inputs)
        plain = self._sample_rows(logits[plain_rows], plain_states, scheduler_output) if plain_states else None
        if plain is not None:
            tokens |= dict(zip(plain.req_ids, plain.sampled_token_ids, strict=True))
        logprobs = None
        if plain is not None and plain.logprobs is not None:  # drafts never go with logprobs
            by_id = dict(zip(plain.req_ids, plain.logprobs, strict=True))
            logprobs = [by_id.get(s.req_id, []) for s in states]
        return ModelRunnerOutput([s.req_id for s in states], [tokens[s.req_id] for s in states], logprobs)

    def _sample_rows(
        self, logits: torch.Tensor, states: list[CachedRequestState], scheduler_output: SchedulerOutput
    ) -> ModelRunnerOutput:
        batch = self.sampling_inputs.batch(states)
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
