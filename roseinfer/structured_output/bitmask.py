"""Token bitmasks for a step: one int32 row of bits per constrained request (bit t of a row set
when token t is allowed), filled by llguidance and applied to the logits before sampling."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import llguidance
import llguidance.numpy
import numpy as np
import torch

if TYPE_CHECKING:
    from roseinfer.structured_output.backend import Grammar

_executor: llguidance.LLExecutor | None = None


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A (rows, ceil(vocab_size / 32)) int32 CPU tensor, every token allowed (pinned when CUDA is
    there, so that it copies to the GPU without a sync).

    The bitmask helpers used are llguidance's numpy ones, on a view of this tensor: importing
    `llguidance.torch` imports torch's compiler stack (~120 MB resident and 2 s for every process
    that loads roseinfer) for a torch.compile'd function we do not use (see `apply_bitmask`)."""
    shape = llguidance.numpy.get_bitmask_shape(rows, vocab_size)
    return torch.full(shape, -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())


def fill_bitmasks(grammars: Sequence[tuple[Grammar, int]], bitmask: torch.Tensor) -> None:
    """Write each grammar's allowed next tokens into its row of `bitmask`, in parallel on
    llguidance's own threads (the GIL is released while they work)."""
    global _executor
    if not grammars:
        return
    if _executor is None:
        _executor = llguidance.LLExecutor()
    llguidance.numpy.fill_next_token_bitmask_par(
        _executor, [(grammar.matcher, row) for grammar, row in grammars], bitmask.numpy()
    )


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None
) -> None:
    """In place: logits[rows[i], t] = -inf wherever bit t of bitmask[i] is clear, and for every
    column past the bitmask's width (a model whose logits are wider than the grammar's
    vocabulary). Without `rows`, bitmask row i applies to logits row i. Other rows are untouched.

    No compile step (llguidance.torch's version is torch.compile'd: half a minute for its first
    call on a CPU).
    """
    if rows is None:
        rows = range(bitmask.shape[0])
    if len(rows) == 0:
        return
    if len(rows) > bitmask.shape[0]:
        raise ValueError(f"{len(rows)} logits rows for a bitmask of {bitmask.shape[0]} rows")
    allowed = _unpack(bitmask[: len(rows)], logits.device)
    width = min(logits.shape[-1], allowed.shape[-1])
    index = torch.as_tensor(list(rows), dtype=torch.long, device=logits.device)
    selected = logits.index_select(0, index)
    selected[:, :width].masked_fill_(~allowed[:, :width], float("-inf"))
    selected[:, width:] = float("-inf")
    logits.index_copy_(0, index, selected)


def _unpack(bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """(rows, words) int32 bits -> (rows, words * 32) bool on `device`; bit t of a row is bit
    t % 32 of word t // 32, which is bit t % 8 of byte t // 8 in a little-endian machine."""
    if device.type == "cpu":  # numpy's C unpacking: torch's shifts are ~100x slower on a CPU
        data = np.ascontiguousarray(bitmask.numpy()).view(np.uint8)
        return torch.from_numpy(np.unpackbits(data, axis=1, bitorder="little")).bool()
    return _unpack_on_device(bitmask, device)


def _unpack_on_device(bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """_unpack with torch ops on `device` (a GPU): only the packed bits are copied there."""
    table = _BYTE_BITS.get(device)
    if table is None:
        table = _BYTE_BITS[device] = (
            (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1
        ).bool()
    data = bitmask.to(device, non_blocking=True).contiguous().view(torch.uint8)
    return table.index_select(0, data.flatten().int()).view(data.shape[0], -1)


_BYTE_BITS: dict[torch.device, torch.Tensor] = {}  # per device: the 8 bits of each byte value
