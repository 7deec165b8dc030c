"""The engine configuration planned against the model: the dtype `auto` stands for, the longest
sequence, and how many blocks each KV cache group's pool gets (what the configuration can use at
once, capped by --kv-cache-memory). The pools' memory is committed only as blocks are first written."""

from __future__ import annotations

import logging

import torch

from roseinfer.common.kv_cache_spec import model_kv_cache_groups, sliding_blocks_per_sequence
from roseinfer.config import GIB, EngineConfig, ModelConfig
from roseinfer.distributed.partition import check_tensor_parallel
from roseinfer.errors import InvalidRequestError
from roseinfer.layers.cpu_kernels import cpu_has_bfloat16_dot_products
from roseinfer.layers.recurrent import recurrent_state_spec

logger = logging.getLogger("roseinfer")


def plan_engine(config: EngineConfig, model_config: ModelConfig) -> None:
    """Fill in what depends on the model: `max_model_len` (the model's context, or less when
    asked or when the pool cannot hold it) and the KV pool's block count: what the
    configuration can use at once (max_num_seqs sequences of max_model_len tokens), capped by
    --kv-cache-memory (per rank under tensor parallelism). The pool's memory is committed only
    as blocks are first written."""
    check_tensor_parallel(model_config, config.tensor_parallel_size)
    if config.dtype == "auto":
        config.dtype = _auto_dtype(config, model_config)
    if model_config.recurrent is not None:
        _plan_recurrent(config, model_config)
    head_dims = {model_config.layer_kv_shape(layer)[1] for layer in model_config.kv_pool_layers()}
    if config.kv_cache_torch_dtype == torch.int8 and any(head_dim % 32 for head_dim in head_dims):
        raise InvalidRequestError(
            "kv_cache_dtype q8_0 needs a head size that is a multiple of 32; this model's is "
            f"{' and '.join(map(str, sorted(head_dims)))}", "kv_cache_dtype",
        )
    kv_dtype, dtype = config.kv_cache_torch_dtype, config.torch_dtype
    if config.torch_device.type == "cpu" and dtype != torch.float32 and kv_dtype not in (dtype, torch.int8):
        # The CPU kernels store and read a pool of another dtype only for float32 models.
        name = str(dtype).removeprefix("torch.")
        raise InvalidRequestError(
            f"kv_cache_dtype {config.kv_cache_dtype} with dtype {name}: on the CPU a {name} model keeps its keys"
            f" and values in {name} (auto) or q8_0; only a float32 model's cache can be another dtype",
            "kv_cache_dtype",
        )
    context = model_config.context_length
    if config.max_model_len is not None and config.max_model_len > context:
        raise InvalidRequestError(
            f"max_model_len {config.max_model_len} exceeds the model's context length {context}",
            "max_model_len",
        )
    length = config.max_model_len or context
    # What one sequence holds at most: all of it, or with a sliding window on every layer its
    # span plus one step's tokens (older blocks are released, see core/kv_cache/).
    held = length
    if model_config.attention_span is not None:
        held = min(length, model_config.attention_span + config.max_num_batched_tokens + config.block_size)
    specs = model_kv_cache_groups(model_config)
    paged = [spec for spec in specs if spec.paged]
    windows = [spec.window for spec in paged]
    if len(windows) == 1 and config.num_kv_blocks_sliding is not None:
        raise InvalidRequestError(
            "num_kv_blocks_sliding applies to a model with both full-attention and sliding-window layers; "
            f"{model_config.architecture}'s layers are all one kind (use num_kv_blocks)", "num_kv_blocks_sliding",
        )
    full_block = model_config.kv_block_bytes(config.block_size, kv_dtype, config.tensor_parallel_size,
                                             layers=paged[0].layers)
    sliding_block = model_config.kv_block_bytes(config.block_size, kv_dtype, config.tensor_parallel_size,
                                                layers=[layer for spec in paged[1:] for layer in spec.layers])
    usable = config.max_num_seqs * -(-held // config.block_size)
    # A sequence holds at most this many blocks in a sliding group (see common/kv_cache_spec.py).
    sliding_usable = 0
    if len(windows) > 1:
        per_sequence = min(-(-length // config.block_size), sliding_blocks_per_sequence(
            max(windows[1:]), config.max_num_batched_tokens, config.block_size))
        sliding_usable = config.max_num_seqs * per_sequence
        if config.num_kv_blocks_sliding is not None and config.num_kv_blocks_sliding < per_sequence:
            raise InvalidRequestError(
                f"num_kv_blocks_sliding {config.num_kv_blocks_sliding} is fewer than one sequence's sliding-window "
                f"layers may hold ({per_sequence} blocks of {config.block_size} tokens)", "num_kv_blocks_sliding",
            )
    if config.num_kv_blocks is None:
        gib = config.kv_cache_memory or config.DEFAULT_KV_CACHE_GIB
        budget = int(gib * GIB)
        if config.num_kv_blocks_sliding is not None:
            budget -= config.num_kv_blocks_sliding * sliding_block
        elif sliding_usable:
            # A sequence never holds more sliding blocks than full ones, so a sliding pool as
            # large as the full pool never runs out first: the pools grow together up to the
            # sliding pool's use (max_num_seqs windows), then the full pool takes the rest.
            together = budget // (full_block + sliding_block)
            if together >= sliding_usable:
                budget -= sliding_usable * sliding_block
            else:
                budget = together * full_block
        blocks = budget // full_block
        if blocks < 1:  # (a model with one kind of layers has no sliding block: 0 bytes)
            raise InvalidRequestError(
                f"kv_cache_memory {gib} GiB holds no block of {full_block + sliding_block} bytes", "kv_cache_memory"
            )
        config.num_kv_blocks = min(blocks, usable)
    if sliding_usable and config.num_kv_blocks_sliding is None:
        config.num_kv_blocks_sliding = min(config.num_kv_blocks, sliding_usable)
    capacity = config.num_kv_blocks * config.block_size
    if capacity < held:
        logger.warning(
            "the KV cache holds %d tokens, fewer than one sequence may hold (%d): "
            "max_model_len lowered to %d (raise --kv-cache-memory for longer requests)",
            capacity, held, capacity,
        )
        length = capacity
    config.max_model_len = length


def _plan_recurrent(config: EngineConfig, model_config: ModelConfig) -> None:
    """A hybrid model's recurrent layers keep one state per sequence, not per block: a cached
    prefix's blocks cannot give the state after it, so the prefix cache keeps snapshots of states at
    block boundaries (core/kv_cache/recurrent_state.py), as many as `num_state_snapshots` or, by
    default, as a quarter of the KV cache memory holds (up to SNAPSHOTS_PER_SEQUENCE per sequence);
    where not even one fits, prefix caching is off, and the log says why. A rejected draft token
    cannot be taken back out of a state (no rollback yet), and the layers are not cut across ranks."""
    rec = model_config.recurrent
    per_sequence = recurrent_state_spec(rec.kind, rec.params, rec.layers).slot_bytes(config.torch_dtype)
    _plan_state_snapshots(config, model_config, per_sequence)
    logger.info("recurrent state: %.1f MiB per sequence (%d %s layers), up to %.0f MiB for %d sequences",
                per_sequence / 2**20, len(rec.layers), rec.kind, per_sequence * (config.max_num_seqs + 1) / 2**20,
                config.max_num_seqs)
    if config.tensor_parallel_size > 1:
        raise InvalidRequestError(
            f"tensor parallelism is not supported for {model_config.architecture}: its recurrent layers "
            f"({model_config.recurrent.kind}) run on one rank only yet", "tensor_parallel_size",
        )
    if config.speculative_config is not None:
        raise InvalidRequestError(
            f"speculative decoding is not supported for {model_config.architecture}: its recurrent layers "
            f"({model_config.recurrent.kind}) cannot roll back rejected draft tokens yet", "speculative_config",
        )


SNAPSHOTS_PER_SEQUENCE = 4  # the default snapshot pool's most: prompt chunks' and prompts' ends
SNAPSHOT_MEMORY_SHARE = 0.25  # of the KV cache memory, the most the default snapshot pool takes


def _plan_state_snapshots(config: EngineConfig, model_config: ModelConfig, slot_bytes: int) -> None:
    """Size the prefix cache's state snapshot pool (config.num_state_snapshots), or turn prefix
    caching off for this model where no snapshot is kept, saying why."""
    name, kind = model_config.architecture, model_config.recurrent.kind
    if not config.enable_prefix_caching:
        config.num_state_snapshots = 0
        return
    if config.num_state_snapshots is None:
        budget = SNAPSHOT_MEMORY_SHARE * (config.kv_cache_memory or config.DEFAULT_KV_CACHE_GIB) * GIB
        config.num_state_snapshots = min(SNAPSHOTS_PER_SEQUENCE * config.max_num_seqs, int(budget // slot_bytes))
        if not config.num_state_snapshots:
            logger.warning(
                "prefix caching is off: one snapshot of %s's recurrent state (%s layers) takes %.1f MiB, more than "
                "the snapshot budget of %.1f MiB (a quarter of --kv-cache-memory); raise --kv-cache-memory to "
                "resume cached prefixes", name, kind, slot_bytes / 2**20, budget / 2**20)
    elif not config.num_state_snapshots:
        logger.info("prefix caching is off: num_state_snapshots 0 keeps no snapshot of %s's recurrent state "
                    "(%s layers), so a cached prefix could not be resumed", name, kind)
    if not config.num_state_snapshots:
        config.enable_prefix_caching = False
        return
    logger.info("prefix caching keeps up to %d snapshots of the recurrent state at block boundaries "
                "(%.1f MiB each, up to %.0f MiB, committed as written)", config.num_state_snapshots,
                slot_bytes / 2**20, config.num_state_snapshots * slot_bytes / 2**20)


def _auto_dtype(config: EngineConfig, model_config: ModelConfig) -> str:
    """--dtype auto: bfloat16 on a GPU; on the CPU float32, except that with --quantization auto a
    bfloat16 checkpoint stays bfloat16 where the CPU has bfloat16 dot products (elsewhere its
    matrix products would be emulated, far slower than float32)."""
    if config.torch_device.type == "cuda":
        return "bfloat16"
    if config.quantization == "auto" and model_config.checkpoint_dtype == "bfloat16":
        if cpu_has_bfloat16_dot_products():
            return "bfloat16"
    return "float32"
