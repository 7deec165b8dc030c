"""Mamba2 (the state-space layers of Granite 4's granitemoehybrid) over a flattened batch, with each
sequence's state in a pool slot.

Per token and head h (head_dim P, state size N, heads sharing B and C in groups), with
dt = softplus(dt_raw + dt_bias) and A = -exp(A_log):
    S <- exp(dt A) S + dt x B^T;  y = S C + D x
x, B and C come from one projection through a short causal convolution (with bias) and SiLU; y is
gated by SiLU(z), RMS-normalised per group and projected out.

Decode tokens take that step for all sequences at once; prefill chunks the state-space dual form
(blocks of 64: within a block y is a masked product of C B^T weighted by the decays, the only
sequential loop is over blocks), chunks of different sequences padded to the same number of
blocks; a chunk with tokens already computed starts from its sequence's stored state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.distributed.parallel_state import get_tp_group
from roseinfer.errors import ModelLoadError
from roseinfer.layers.attention import AttentionMetadata
from roseinfer.layers.recurrent.conv import conv_decode, conv_prefill
from roseinfer.layers.recurrent.spec import StateTensorSpec

CHUNK = 64


@dataclass(frozen=True)
class Mamba2Params:
    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int  # N
    num_groups: int
    conv_kernel: int
    norm_eps: float
    conv_bias: bool = True
    proj_bias: bool = False

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x, B and C."""
        return self.inner_size + 2 * self.num_groups * self.state_size


def chunked_ssd(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [batch, heads, T, P], dt [batch, heads, T] (after softplus; 0 on padding), a [heads],
    b, c [batch, heads, T, N] (float32, T a multiple of `chunk`), state [batch, heads, P, N] ->
    (y without the D skip [batch, heads, T, P], the state after the last token).

    In a block, with c_i the cumulative log decay (dt a) up to token i:
        y_i = e^{c_i} S0 C_i + sum_{j<=i} e^{c_i - c_j} (C_i . B_j) dt_j x_j."""
    batch, heads, length, head_dim = x.shape
    blocks = length // chunk
    x, b, c = (t.reshape(batch, heads, blocks, chunk, t.shape[-1]) for t in (x, b, c))
    dt = dt.reshape(batch, heads, blocks, chunk)
    decay = (dt * a[None, :, None, None]).cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    scores = (c @ b.transpose(-1, -2)) * pairwise * dt[..., None, :]
    within = scores @ x  # [batch, heads, blocks, chunk, P]
    c_decayed = c * decay.exp()[..., None]
    total = decay[..., -1]
    x_to_end = x * (dt * (total[..., None] - decay).exp())[..., None]
    out = torch.empty_like(x)
    for block in range(blocks):
        out[:, :, block] = within[:, :, block] + c_decayed[:, :, block] @ state.transpose(-1, -2)
        state = state * total[:, :, block, None, None].exp() + x_to_end[:, :, block].transpose(-1, -2) @ b[:, :, block]
    return out.reshape(batch, heads, length, head_dim), state


class Mamba2Mixer(nn.Module):
    """Parameters: `in_proj` (rows z, then x B C, then dt), `conv_weight` [conv_dim, kernel] and
    `conv_bias`, `dt_bias`, `decay_rate` (= A = -exp(A_log)), `skip` (D) per head, `norm_weight`
    [inner_size], `out_proj`."""

    kind = "mamba2"

    def __init__(self, params: Mamba2Params) -> None:
        super().__init__()
        if get_tp_group().size > 1:
            raise ModelLoadError("Mamba2 layers do not run under tensor parallelism yet")
        if params.num_heads % params.num_groups:
            raise ModelLoadError(f"{params.num_heads} Mamba2 heads cannot share {params.num_groups} groups")
        self.params = p = params
        self.in_proj = nn.Linear(p.hidden_size, p.inner_size + p.conv_dim + p.num_heads, bias=p.proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(p.conv_dim, p.conv_kernel))
        self.conv_bias = nn.Parameter(torch.empty(p.conv_dim)) if p.conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(p.num_heads))
        self.decay_rate = nn.Parameter(torch.empty(p.num_heads))
        self.skip = nn.Parameter(torch.empty(p.num_heads))
        self.norm_weight = nn.Parameter(torch.empty(p.inner_size))
        self.out_proj = nn.Linear(p.inner_size, p.hidden_size, bias=p.proj_bias)

    @staticmethod
    def state_tensors(params: Mamba2Params) -> tuple[StateTensorSpec, ...]:
        return (
            StateTensorSpec("conv", (params.conv_kernel - 1, params.conv_dim)),
            StateTensorSpec("ssm", (params.num_heads, params.head_dim, params.state_size), "float32"),
        )

    def forward(
        self, hidden: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """As GatedDeltaNet.forward: the step's tokens, this layer's pools, each sequence's slot."""
        p = self.params
        num_tokens = hidden.shape[0]
        z, xbc, dt = self.in_proj(hidden).split([p.inner_size, p.conv_dim, p.num_heads], -1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        conv_pool, ssm_pool = state
        slots, num_decodes = meta.state_slots, meta.num_decode_tokens
        y = torch.empty(num_tokens, p.num_heads, p.head_dim, dtype=torch.float32, device=hidden.device)
        if num_decodes:
            fresh = meta.decode_context_lens == 1
            convolved = F.silu(conv_decode(xbc[:num_decodes], self.conv_weight, self.conv_bias, conv_pool,
                                           slots[:num_decodes], fresh))
            x, b, c = self._split(convolved)
            s = ssm_pool.index_select(0, slots[:num_decodes]).masked_fill(fresh[:, None, None, None], 0)
            step = dt[:num_decodes]
            s = s * (step * self.decay_rate.float()).exp()[..., None, None] + (x * step[..., None])[..., None] * b[:, :, None]
            y[:num_decodes] = (s @ c[..., None])[..., 0] + self.skip.float()[:, None] * x
            ssm_pool.index_copy_(0, slots[:num_decodes], s)
        if meta.prefills:
            self._prefill(xbc, dt, slots[num_decodes:], meta, conv_pool, ssm_pool, y)
        # y gated by SiLU(z), then RMS-normalised per group
        gated = y.reshape(num_tokens, p.inner_size) * F.silu(z.float())
        groups = gated.reshape(num_tokens, p.num_groups, -1)
        normed = (groups * torch.rsqrt(groups.square().mean(-1, keepdim=True) + p.norm_eps)).reshape(num_tokens, -1)
        return self.out_proj(self.norm_weight * normed.to(hidden.dtype))

    def _prefill(
        self, xbc: torch.Tensor, dt: torch.Tensor, slots: torch.Tensor, meta: AttentionMetadata,
        conv_pool: torch.Tensor, ssm_pool: torch.Tensor, out: torch.Tensor,
    ) -> None:
        p, chunks = self.params, meta.prefills
        convolved = F.silu(conv_prefill(xbc, self.conv_weight, self.conv_bias, conv_pool, slots, chunks))
        padded_len = -(-convolved.shape[1] // CHUNK) * CHUNK  # padding rows: dt 0, they write nothing
        convolved = F.pad(convolved, (0, 0, 0, padded_len - convolved.shape[1]))
        steps = dt.new_zeros(len(chunks), padded_len, p.num_heads)
        for row, chunk in enumerate(chunks):
            steps[row, : chunk.query_len] = dt[chunk.query_start : chunk.query_start + chunk.query_len]
        x, b, c = (t.transpose(1, 2) for t in self._split(convolved))  # [count, heads, len, dim]
        continuing = torch.tensor([chunk.num_cached > 0 for chunk in chunks], device=xbc.device)
        state = ssm_pool.index_select(0, slots).masked_fill(~continuing[:, None, None, None], 0)
        y, state = chunked_ssd(x, steps.transpose(1, 2), self.decay_rate.float(), b, c, state)
        ssm_pool.index_copy_(0, slots, state)
        y = (y + self.skip.float()[None, :, None, None] * x).transpose(1, 2)
        for row, chunk in enumerate(chunks):
            out[chunk.query_start : chunk.query_start + chunk.query_len] = y[row, : chunk.query_len]

    def _split(self, convolved: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved [..., conv_dim] -> x [..., heads, head_dim], B and C [..., heads, N] (each
        group's repeated for its heads), float32."""
        p = self.params
        x, b, c = convolved.float().split([p.inner_size, p.num_groups * p.state_size, p.num_groups * p.state_size], -1)
        lead = convolved.shape[:-1]
        per_group = p.num_heads // p.num_groups
        b, c = (t.reshape(*lead, p.num_groups, p.state_size).repeat_interleave(per_group, dim=-2) for t in (b, c))
        return x.reshape(*lead, p.num_heads, p.head_dim), b, c
