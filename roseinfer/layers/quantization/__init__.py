"""Weight formats: one module per family knows how a checkpoint tensor in it is held, sharded and
applied (`dense`: float tensors; `gguf`: GGML block types). `layers/linear.py` chooses among them
per layer. The model code sees only the shape operations below, which every format provides."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from roseinfer.layers.quantization.gguf import BlockTensor, cat_rows


def concat_rows(parts: Sequence[torch.Tensor | BlockTensor]) -> torch.Tensor | BlockTensor:
    """Checkpoint tensors stacked along their rows, whatever their format."""
    if isinstance(parts[0], BlockTensor):
        return cat_rows(parts)
    return torch.cat(list(parts))


def permute_rows(tensor: torch.Tensor | BlockTensor, permute) -> torch.Tensor | BlockTensor:
    """`permute` (a function of a row tensor) applied to the rows of a checkpoint tensor: directly
    to a dense one, through the row order it gives to any other."""
    if isinstance(tensor, torch.Tensor):
        return permute(tensor)
    return tensor.take_rows(permute(torch.arange(tensor.shape[0])))
