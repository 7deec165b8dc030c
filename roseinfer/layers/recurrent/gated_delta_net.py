"""Gated DeltaNet (Qwen3-Next, Qwen3.5 and Qwen3.5-MoE's linear-attention layers) over a flattened
batch, with each sequence's state in a pool slot.

Per token t and value head, the state S (a [head_k_dim, head_v_dim] matrix) decays by exp(g_t),
then the delta rule writes v_t at key k_t with strength beta_t, and the query reads it:
    S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - k_t^T S))^T;  o_t = q_t^T S
q, k, v come from one projection through a short causal depthwise convolution (its last
`conv_kernel - 1` inputs are the other part of a sequence's state) and SiLU; q and k are
L2-normalised, q scaled by head_k_dim ** -0.5; the output is RMS-normalised per head and gated by
SiLU(z).

Decode tokens take the recurrent step above, all sequences at once. A prefill chunk takes the
chunked form (blocks of 64 tokens): within a block the delta rule's updates are one unit
lower-triangular system (the WY / UT form of DeltaNet), solved for all blocks at once, so the only
sequential loop is over blocks, each a few matrix products. Chunks of different sequences are
padded to the same number of blocks and run together; a chunk with tokens already computed starts
from its sequence's stored state, a first chunk from zeros.
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
class GatedDeltaNetParams:
    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    norm_eps: float
    # How value heads share key heads: False, consecutive value heads share one (Hugging Face's
    # layout: value head h reads key head h // r); True, tiled (head h reads key head h % num_k_heads:
    # llama.cpp's converter reorders Qwen3.5's value heads so).
    v_heads_tiled: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v."""
        return 2 * self.key_dim + self.value_dim


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def chunked_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, H, T, dk], v [B, H, T, dv], g and beta [B, H, T] (float32, T a multiple of
    `chunk`), state [B, H, dk, dv] (the state before the first token) -> (outputs [B, H, T, dv],
    the state after the last token). Padding tokens (beta 0, g 0) leave the state as it is.

    In one block, with c_i the cumulative log decay up to token i, the state every token sees is
    the block's initial state S0 decayed plus the earlier tokens' writes u_j decayed:
        u_i = beta_i (v_i - e^{c_i} k_i^T S0 - sum_{j<i} e^{c_i - c_j} (k_i . k_j) u_j),
    a unit lower-triangular system (I + A) u = beta v - beta e^c k S0, solved once per block for
    both right-hand sides (beta v and beta e^c k), so u = U - W S0 needs S0 only in a product."""
    batch, heads, length, dk = k.shape
    blocks = length // chunk
    q, k, v = (x.reshape(batch, heads, blocks, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(batch, heads, blocks, chunk) for x in (g, beta))
    decay = g.cumsum(-1)  # c_i
    # e^{c_i - c_j} for j <= i; the exponent is masked before exp (it is positive above the diagonal).
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    system = (k @ k.transpose(-1, -2)) * pairwise * beta[..., :, None]  # A (its strict lower part)
    rhs = torch.cat([v * beta[..., None], k * (beta * decay.exp())[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    writes, reads = solved[..., : v.shape[-1]], solved[..., v.shape[-1]:]  # U, W
    scores = (q @ k.transpose(-1, -2)) * pairwise  # within the block, the diagonal included
    q_decayed = q * decay.exp()[..., None]
    total = decay[..., -1]  # the block's whole decay
    k_to_end = k * (total[..., None] - decay).exp()[..., None]
    out = torch.empty_like(v)
    for block in range(blocks):
        u = writes[:, :, block] - reads[:, :, block] @ state
        out[:, :, block] = q_decayed[:, :, block] @ state + scores[:, :, block] @ u
        state = state * total[:, :, block, None, None].exp() + k_to_end[:, :, block].transpose(-1, -2) @ u
    return out.reshape(batch, heads, length, -1), state


def recurrent_gated_delta_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of N sequences: q, k [N, H, dk], v [N, H, dv], g, beta [N, H], state
    [N, H, dk, dv] (float32) -> (outputs [N, H, dv], the new state)."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("nhk,nhkv->nhv", k, state)
    state = state + k[..., :, None] * ((v - predicted) * beta[..., None])[..., None, :]
    return torch.einsum("nhk,nhkv->nhv", q, state), state


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer: projections, convolution, delta rule, gated norm, output projection.

    Parameters: `in_proj` (rows q, k, v, z, b, a: the checkpoint's projections fused),
    `conv_weight` [conv_dim, conv_kernel], `dt_bias` and `decay_rate` (= -exp(A_log)) per value
    head, `norm_weight` [head_v_dim], `out_proj`."""

    kind = "gated_delta_net"

    def __init__(self, params: GatedDeltaNetParams) -> None:
        super().__init__()
        if get_tp_group().size > 1:
            raise ModelLoadError("Gated DeltaNet layers do not run under tensor parallelism yet")
        if params.num_v_heads % params.num_k_heads:
            raise ModelLoadError(f"{params.num_v_heads} value heads cannot share {params.num_k_heads} key heads")
        self.params = p = params
        self.in_proj = nn.Linear(p.hidden_size, p.conv_dim + p.value_dim + 2 * p.num_v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(p.conv_dim, p.conv_kernel))
        self.dt_bias = nn.Parameter(torch.empty(p.num_v_heads))
        self.decay_rate = nn.Parameter(torch.empty(p.num_v_heads))
        self.norm_weight = nn.Parameter(torch.empty(p.head_v_dim))
        self.out_proj = nn.Linear(p.value_dim, p.hidden_size, bias=False)

    @staticmethod
    def state_tensors(params: GatedDeltaNetParams) -> tuple[StateTensorSpec, ...]:
        """One sequence's state: the convolution's last inputs, and the delta rule's matrices (in
        float32 whatever the activations, as the recurrence accumulates)."""
        return (
            StateTensorSpec("conv", (params.conv_kernel - 1, params.conv_dim)),
            StateTensorSpec("recurrent", (params.num_v_heads, params.head_k_dim, params.head_v_dim), "float32"),
        )

    def forward(
        self, hidden: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """hidden [num_tokens, hidden] (decode tokens first, then prefill chunks) -> [num_tokens,
        hidden]; reads and writes `state` (this layer's conv and recurrent pools) at
        `meta.state_slots`, one per sequence in batch order."""
        p = self.params
        num_tokens = hidden.shape[0]
        mixed, z, b, a = self.in_proj(hidden).split([p.conv_dim, p.value_dim, p.num_v_heads, p.num_v_heads], -1)
        beta = torch.sigmoid(b.float())
        g = self.decay_rate.float() * F.softplus(a.float() + self.dt_bias.float())
        conv_pool, recurrent_pool = state
        slots = meta.state_slots
        num_decodes = meta.num_decode_tokens
        core = torch.empty(num_tokens, p.num_v_heads, p.head_v_dim, dtype=torch.float32, device=hidden.device)
        if num_decodes:
            fresh = meta.decode_context_lens == 1  # a one-token prompt: no state yet
            self._decode(mixed[:num_decodes], g[:num_decodes], beta[:num_decodes], slots[:num_decodes], fresh,
                         conv_pool, recurrent_pool, core[:num_decodes])
        if meta.prefills:
            self._prefill(mixed, g, beta, slots[num_decodes:], meta, conv_pool, recurrent_pool, core)
        # RMSNorm of each head's output, gated by SiLU(z)
        normed = core * torch.rsqrt(core.square().mean(-1, keepdim=True) + p.norm_eps)
        normed = normed.to(hidden.dtype) * self.norm_weight
        gated = normed.float() * F.silu(z.float().view(num_tokens, p.num_v_heads, p.head_v_dim))
        return self.out_proj(gated.to(hidden.dtype).view(num_tokens, p.value_dim))

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved [..., conv_dim] -> q, k [..., num_v_heads, head_k_dim] (normalised, q scaled,
        each key head repeated for the value heads that read it), v [..., num_v_heads, head_v_dim],
        all float32."""
        p = self.params
        q, k, v = mixed.float().split([p.key_dim, p.key_dim, p.value_dim], -1)
        lead = mixed.shape[:-1]
        q = l2_normalize(q.reshape(*lead, p.num_k_heads, p.head_k_dim)) * p.head_k_dim**-0.5
        k = l2_normalize(k.reshape(*lead, p.num_k_heads, p.head_k_dim))
        repeat = p.num_v_heads // p.num_k_heads
        if repeat > 1:
            if p.v_heads_tiled:
                q, k = (x.repeat(*([1] * len(lead)), repeat, 1) for x in (q, k))
            else:
                q, k = (x.repeat_interleave(repeat, dim=-2) for x in (q, k))
        return q, k, v.reshape(*lead, p.num_v_heads, p.head_v_dim)

    def _decode(
        self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor,
        conv_pool: torch.Tensor, recurrent_pool: torch.Tensor, out: torch.Tensor,
    ) -> None:
        convolved = F.silu(conv_decode(mixed, self.conv_weight, None, conv_pool, slots, fresh))
        q, k, v = self._heads(convolved)
        state = recurrent_pool.index_select(0, slots).masked_fill(fresh[:, None, None, None], 0)
        out[:], state = recurrent_gated_delta_step(q, k, v, g, beta, state)
        recurrent_pool.index_copy_(0, slots, state)

    def _prefill(
        self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor, meta: AttentionMetadata,
        conv_pool: torch.Tensor, recurrent_pool: torch.Tensor, out: torch.Tensor,
    ) -> None:
        p, chunks = self.params, meta.prefills
        convolved = F.silu(conv_prefill(mixed, self.conv_weight, None, conv_pool, slots, chunks))
        # Padded to whole blocks: padding rows have beta 0 and g 0, so they write nothing.
        padded_len = -(-convolved.shape[1] // CHUNK) * CHUNK
        convolved = F.pad(convolved, (0, 0, 0, padded_len - convolved.shape[1]))
        gates = g.new_zeros(len(chunks), padded_len, p.num_v_heads)
        betas = beta.new_zeros(len(chunks), padded_len, p.num_v_heads)
        for row, chunk in enumerate(chunks):
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            gates[row, : chunk.query_len] = g[rows]
            betas[row, : chunk.query_len] = beta[rows]
        q, k, v = (x.transpose(1, 2) for x in self._heads(convolved))  # [count, heads, len, dim]
        continuing = torch.tensor([chunk.num_cached > 0 for chunk in chunks], device=mixed.device)
        state = recurrent_pool.index_select(0, slots).masked_fill(~continuing[:, None, None, None], 0)
        result, state = chunked_gated_delta_rule(q, k, v, gates.transpose(1, 2), betas.transpose(1, 2), state)
        recurrent_pool.index_copy_(0, slots, state)
        result = result.transpose(1, 2)
        for row, chunk in enumerate(chunks):
            out[chunk.query_start : chunk.query_start + chunk.query_len] = result[row, : chunk.query_len]
