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
from roseinfer.layers.linear import INT8_GROUP_SIZE, ROWS_PER_RUN, quantize_int8_groups


def take_shard(tensor: torch.Tensor, dim: int, start: int, size: int) -> torch.Tensor:
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

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a [vocab, hidden] checkpoint tensor, zero-padded past the vocabulary."""
        rows = tensor[self.start : min(self.end, self.vocab_size)]
        if rows.shape[0] == self.rows:
            return rows
        padding = tensor.new_zeros((self.rows - rows.shape[0], *tensor.shape[1:]))
        return torch.cat([rows, padding])


class VocabParallelEmbedding(nn.Module):
    """Token embeddings split by vocabulary rows: each rank looks up the ids it holds, writes zeros
    for the others, and one all-reduce puts every row together.

    `store_as_8bit_blocks_if_exact` may then keep the table as GGUF Q8_0 blocks (int8 codes, a scale
    per 32), expanding only the rows looked up: a quarter of the memory, with the same values."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.group = get_tp_group()
        self.shard = VocabShard(vocab_size, self.group)
        self.weight = nn.Parameter(torch.empty(self.shard.rows, hidden_size))
        self.codes: torch.Tensor | None = None  # [rows, hidden] int8, once stored as blocks
        self.scales: torch.Tensor | None = None  # [rows, hidden / 32] float32

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return self._rows(input_ids)
        outside = (input_ids < self.shard.start) | (input_ids >= self.shard.end)
        local_ids = (input_ids - self.shard.start).masked_fill_(outside, 0)
        embedded = self._rows(local_ids).masked_fill_(outside[:, None], 0.0)
        return self.group.all_reduce(embedded)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.codes is None:
            return F.embedding(ids, self.weight)
        return _expand_blocks(self.codes.index_select(0, ids), self.scales.index_select(0, ids)).to(self.weight.dtype)

    def store_as_8bit_blocks_if_exact(self) -> bool:
        """Keep the table as 8-bit blocks when they give back exactly the same values (as a table
        loaded from a Q8_0 GGUF file does: the default model's does). Call only once nothing else
        holds the weight (a tied LM head must have its own copy by then, or read these blocks:
        see `registry.share_tied_head_blocks`)."""
        if self.codes is not None or self.weight.shape[1] % INT8_GROUP_SIZE:
            return self.codes is not None
        codes, scales = quantize_int8_groups(self.weight)
        for start in range(0, self.weight.shape[0], ROWS_PER_RUN):  # run by run, as quantizing does
            run = slice(start, start + ROWS_PER_RUN)
            if not torch.equal(_expand_blocks(codes[run], scales[run]).to(self.weight.dtype), self.weight[run]):
                return False
        self.codes, self.scales = codes, scales
        # An empty parameter keeps the dtype and device the rest of the code reads from it.
        self.weight = nn.Parameter(self.weight.new_empty(0, self.weight.shape[1]), requires_grad=False)
        return True


def _expand_blocks(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows = codes.shape[0]
    return (codes.float().view(rows, -1, INT8_GROUP_SIZE) * scales[..., None]).view(rows, -1)


def store_embeddings_compactly(model: nn.Module) -> int:
    """Store every vocabulary embedding of `model` as 8-bit blocks where that is lossless and the
    table is not shared (with a tied LM head still reading it); returns how many."""
    uses: dict[int, int] = {}
    for _, tensor in model.named_parameters(remove_duplicate=False):
        uses[id(tensor)] = uses.get(id(tensor), 0) + 1
    compacted = 0
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and uses.get(id(module.weight)) == 1:
            compacted += module.store_as_8bit_blocks_if_exact()
    return compacted


def gather_logits(logits: torch.Tensor, vocab_size: int, group: TensorParallelGroup) -> torch.Tensor | None:
    """The full-vocabulary logits on rank 0 from every rank's LM-head rows (padding dropped);
    None on the other ranks."""
    full = group.gather_last_dim(logits)
    if full is None or full.shape[-1] == vocab_size:
        return full
    return full[..., :vocab_size]
