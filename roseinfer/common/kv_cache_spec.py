"""KV cache groups: the model's layers grouped by the kind of attention they compute, each group
with a pool of its own (the idea of vLLM v1's hybrid allocator).

A model whose layers are all one kind (Llama: every layer global; Mistral: a window on every
layer) has one group, and one block table per request serves all its layers, as before. A model
with both kinds (Gemma 2: local and global layers alternating; Gemma 3: five local to one global)
has a group of full-attention layers, which keeps every block of a sequence, and one group per
sliding window W, whose layers never read a key more than W positions back: that group releases
the blocks that fall wholly before its window as the sequence grows, so a sequence holds at most
`sliding_blocks_per_sequence` of its blocks however long it gets.

A model with recurrent layers (Qwen3.5's Gated DeltaNet, `ModelConfig.layer_types` entries
"linear_attention") has a recurrent-state group after its attention groups: one fixed-size state
slot per sequence, the same slot in each of its layers (core/kv_cache/recurrent_state.py).

Group 0 is the full-attention group where there is one; a sliding group is named by its window,
which is how a layer (which knows its window) finds its group's tables in a step's metadata. A
request's block table is one list per group in this order (a recurrent group's holds its slot).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from roseinfer.config import ModelConfig

GroupKind = Literal["full", "sliding", "recurrent"]
RECURRENT_LAYER_TYPES = frozenset({"linear_attention"})  # transformers' names of recurrent layers


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV cache group: its kind, its layers (model layer indices) and, sliding, its window."""

    kind: GroupKind
    layers: tuple[int, ...]
    window: int | None = None

    @property
    def paged(self) -> bool:
        """Whether its pool is in KV blocks (attention), rather than a state slot per sequence."""
        return self.kind != "recurrent"


def kv_cache_groups(
    layer_windows: Sequence[int | None], recurrent_layers: Sequence[int] = ()
) -> list[KVCacheGroupSpec]:
    """The model's groups in block-table order: its attention layers' (see kv_group_windows), then
    one recurrent group of `recurrent_layers` where it has any."""
    recurrent = set(recurrent_layers)
    attention = [layer for layer in range(len(layer_windows)) if layer not in recurrent]
    windows = [layer_windows[layer] for layer in attention]
    groups = []
    if attention:
        for group, window in enumerate(kv_group_windows(windows)):
            layers = tuple(layer for layer, g in zip(attention, layer_kv_groups(windows), strict=True) if g == group)
            groups.append(KVCacheGroupSpec("full" if window is None else "sliding", layers, window))
    if recurrent:
        groups.append(KVCacheGroupSpec("recurrent", tuple(sorted(recurrent))))
    return groups


def model_kv_cache_groups(model_config: ModelConfig) -> list[KVCacheGroupSpec]:
    return kv_cache_groups(model_config.layer_windows, model_config.recurrent_layers)


def layer_groups(groups: Sequence[KVCacheGroupSpec], num_layers: int) -> list[int]:
    """Each layer's index in `groups`."""
    owner = [0] * num_layers
    for index, group in enumerate(groups):
        for layer in group.layers:
            owner[layer] = index
    return owner


def group_pool_sizes(
    groups: Sequence[KVCacheGroupSpec], num_kv_blocks: int, num_kv_blocks_sliding: int | None,
    num_state_slots: int | None,
) -> list[int]:
    """Each group's pool size, as the pool plan (core/kv_pool_plan.py) sized them: blocks of the
    full pool (or of the one attention group's), of the sliding pool, or state slots."""
    attention = sum(group.paged for group in groups)
    return [num_state_slots if not group.paged
            else num_kv_blocks_sliding if group.kind == "sliding" and attention > 1
            else num_kv_blocks for group in groups]


def kv_group_windows(layer_windows: Sequence[int | None]) -> list[int | None]:
    """The groups' windows (None: full attention), group 0 first. One group when every layer is
    of one kind: None, or with a window on every layer the largest (the span any layer reads)."""
    windows = list(layer_windows)
    if None not in windows or all(window is None for window in windows):
        return [max(windows) if windows and None not in windows else None]
    return [None, *sorted({window for window in windows if window is not None})]


def layer_kv_groups(layer_windows: Sequence[int | None]) -> list[int]:
    """Each layer's group index (see kv_group_windows)."""
    windows = kv_group_windows(layer_windows)
    if len(windows) == 1:
        return [0] * len(layer_windows)
    return [windows.index(window) for window in layer_windows]


def sliding_blocks_per_sequence(window: int, max_chunk: int, block_size: int) -> int:
    """The most blocks one sequence holds in a group with this window: those of the window before
    a step's first new token, and of the step's at most `max_chunk` new tokens, plus one where
    they straddle a block boundary (see core/kv_cache/full_attention.py's _num_released)."""
    return -(-(window + max_chunk) // block_size) + 1
