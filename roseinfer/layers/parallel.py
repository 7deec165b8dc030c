"""The tensor-parallel pieces of the model code (Megatron's layout).

Column-parallel layers (q/k/v, gate/up) hold a slice of the output rows and need no
communication; row-parallel layers (the attention output and MLP down projections) hold the
matching slice of input columns, and their partial results are summed with one all-reduce. The
embedding and the LM head are split by vocabulary rows. Layers stay plain `nn.Linear` with the
shard's shape, so the kernels of `prepare_linear_layers` apply to shards as they are.

`take_shard` cuts a checkpoint tensor to this rank's part at load time, so a rank only ever keeps
its own slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.distributed.parallel_state import TensorParallelGroup, get_tp_group
from roseinfer.distributed.partition import padded_vocab_size
from roseinfer.layers.quantization import concat_rows
from roseinfer.layers.quantization.gguf import BlockTensor, PackedBlocks


def take_shard(tensor: torch.Tensor | BlockTensor, dim: int, start: int, size: int) -> torch.Tensor | BlockTensor:
    """This rank's slice of a full checkpoint tensor (a view when it is the whole tensor)."""
    if start == 0 and size == tensor.shape[dim]:
        return tensor
    return tensor.narrow(dim, start, size)


class VocabShard:
    """The vocabulary rows of this rank: the vocabulary padded to a multiple of the rank count,
    cut into equal runs."""

    def __init__(self, vocab_size: int, group: TensorParallelGroup | None = None) -> None:
        group = group or get_tp_group()
        self.vocab_size = vocab_size
        self.rows = padded_vocab_size(vocab_size, group.size) // group.size
        self.start = group.rank * self.rows
        self.end = self.start + self.rows

    def of(self, tensor: torch.Tensor | BlockTensor) -> torch.Tensor | BlockTensor:
        """This rank's rows of a [vocab, hidden] checkpoint tensor, zero-padded past the vocabulary."""
        rows = tensor[self.start : min(self.end, self.vocab_size)]
        if rows.shape[0] == self.rows:
            return rows
        padding = tensor.new_zeros((self.rows - rows.shape[0], *tensor.shape[1:]))
        return concat_rows([rows, padding])


class VocabParallelEmbedding(nn.Module):
    """Token embeddings split by vocabulary rows: each rank looks up the ids it holds, writes zeros
    for the others, and one all-reduce puts every row together.

    A table that came in GGUF blocks keeps them (`use_blocks`): the rows looked up are expanded
    exactly, so the table takes the file's bytes instead of a float copy (the default model's Q8_0
    table: 28 MB instead of 113)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.group = get_tp_group()
        self.shard = VocabShard(vocab_size, self.group)
        self.weight = nn.Parameter(torch.empty(self.shard.rows, hidden_size))
        self.blocks: PackedBlocks | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return self._rows(input_ids)
        outside = (input_ids < self.shard.start) | (input_ids >= self.shard.end)
        local_ids = (input_ids - self.shard.start).masked_fill_(outside, 0)
        embedded = self._rows(local_ids).masked_fill_(outside[:, None], 0.0)
        return self.group.all_reduce(embedded)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.blocks is None:
            return F.embedding(ids, self.weight)
        return self.blocks.rows_of(ids, self.weight.dtype)

    def use_blocks(self, blocks: PackedBlocks) -> None:
        """Keep the table as `blocks` (this rank's rows) and let the float weight go."""
        self.blocks = blocks
        # An empty parameter keeps the dtype and device the rest of the code reads from it.
        self.weight = nn.Parameter(self.weight.new_empty(0, self.weight.shape[1]), requires_grad=False)


def gather_logits(logits: torch.Tensor, vocab_size: int, group: TensorParallelGroup) -> torch.Tensor | None:
    """The full-vocabulary logits on rank 0 from every rank's LM-head rows (padding dropped);
    None on the other ranks."""
    full = group.gather_last_dim(logits)
    if full is None or full.shape[-1] == vocab_size:
        return full
    return full[..., :vocab_size]
