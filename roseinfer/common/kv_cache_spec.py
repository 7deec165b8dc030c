"""KV cache groups: the model's layers grouped by the kind of attention they compute, each group
with a pool of its own (the idea of vLLM v1's hybrid allocator).

A model whose layers are all one kind (Llama: every layer global; Mistral: a window on every
layer) has one group, and one block table per request serves all its layers, as before. A model
with both kinds (Gemma 2: local and global layers alternating; Gemma 3: five local to one global)
has a group of full-attention layers, which keeps every block of a sequence, and one group per
sliding window W, whose layers never read a key more than W positions back: that group releases
the blocks that fall wholly before its window as the sequence grows, so a sequence holds at most
`sliding_blocks_per_sequence` of its blocks however long it gets.

Group 0 is the full-attention group where there is one; a sliding group is named by its window,
which is how a layer (which knows its window) finds its group's tables in a step's metadata.
"""

from __future__ import annotations

from collections.abc import Sequence


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
    they straddle a block boundary (see KVCacheManager._num_released)."""
    return -(-(window + max_chunk) // block_size) + 1
