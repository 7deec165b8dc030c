"""The short causal depthwise convolution that recurrent layers run over their inputs (Gated
DeltaNet's q/k/v, LFM2's gated input, Mamba2's x/B/C), over a flattened batch: a sequence's state
is its last `kernel - 1` inputs, kept in a pool slot `[kernel - 1, channels]`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from roseinfer.layers.attention import PrefillChunk


def conv_decode(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pool: torch.Tensor, slots: torch.Tensor,
    fresh: torch.Tensor,
) -> torch.Tensor:
    """One new input per sequence: x [N, channels], weight [channels, kernel]; `fresh` [N] marks
    sequences with no state yet (their first token). Returns the convolution [N, channels] (no
    activation) and writes each sequence's new state to its slot."""
    state = pool.index_select(0, slots).masked_fill(fresh[:, None, None], 0)
    window = torch.cat([state, x[:, None].to(state.dtype)], dim=1)  # [N, kernel, channels]
    pool.index_copy_(0, slots, window[:, 1:])
    out = (window * weight.t().to(window.dtype)).sum(1)
    return out if bias is None else out + bias.to(out.dtype)


def conv_prefill(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pool: torch.Tensor, slots: torch.Tensor,
    chunks: list[PrefillChunk],
) -> torch.Tensor:
    """Each prefill chunk's rows of x [num_tokens, channels], after its sequence's state (zeros for
    a first chunk), convolved together: [len(chunks), longest chunk, channels] (rows past a
    chunk's end are padding). Writes each sequence's new state (its last kernel - 1 inputs)."""
    width = weight.shape[1] - 1
    longest = max(chunk.query_len for chunk in chunks)
    continuing = torch.tensor([chunk.num_cached > 0 for chunk in chunks], device=x.device)
    inputs = x.new_zeros(len(chunks), width + longest, x.shape[1])
    inputs[:, :width] = pool.index_select(0, slots).to(x.dtype).masked_fill(~continuing[:, None, None], 0)
    for row, chunk in enumerate(chunks):
        inputs[row, width:width + chunk.query_len] = x[chunk.query_start : chunk.query_start + chunk.query_len]
    ends = torch.tensor([chunk.query_len for chunk in chunks], device=x.device)
    last = ends[:, None] + torch.arange(width, device=x.device)  # each chunk's last `width` inputs
    pool.index_copy_(0, slots, inputs.gather(1, last[..., None].expand(-1, -1, x.shape[1])).to(pool.dtype))
    out = F.conv1d(inputs.transpose(1, 2), weight[:, None, :].to(inputs.dtype),
                   None if bias is None else bias.to(inputs.dtype), groups=x.shape[1])
    return out.transpose(1, 2)
