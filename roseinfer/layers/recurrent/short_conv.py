"""LFM2's short convolution: a gated depthwise causal convolution, the only token mixing of LFM2's
"conv" layers. in_proj gives B, C and x; the layer convolves B * x over the last `kernel` positions
and gates the result by C, then out_proj. A sequence's state is its last kernel - 1 values of B * x
(layers/recurrent/conv.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from roseinfer.distributed.parallel_state import get_tp_group
from roseinfer.errors import ModelLoadError
from roseinfer.layers.attention import AttentionMetadata
from roseinfer.layers.recurrent.conv import conv_decode, conv_prefill
from roseinfer.layers.recurrent.spec import StateTensorSpec


@dataclass(frozen=True)
class ShortConvParams:
    hidden_size: int
    kernel: int  # LFM2's conv_L_cache
    bias: bool = False


class ShortConv(nn.Module):
    kind = "short_conv"

    def __init__(self, params: ShortConvParams) -> None:
        super().__init__()
        if get_tp_group().size > 1:
            raise ModelLoadError("short-convolution layers do not run under tensor parallelism yet")
        self.params = p = params
        self.in_proj = nn.Linear(p.hidden_size, 3 * p.hidden_size, bias=p.bias)
        self.conv_weight = nn.Parameter(torch.empty(p.hidden_size, p.kernel))
        self.conv_bias = nn.Parameter(torch.empty(p.hidden_size)) if p.bias else None
        self.out_proj = nn.Linear(p.hidden_size, p.hidden_size, bias=p.bias)

    @staticmethod
    def state_tensors(params: ShortConvParams) -> tuple[StateTensorSpec, ...]:
        return (StateTensorSpec("conv", (params.kernel - 1, params.hidden_size)),)

    def forward(self, hidden: torch.Tensor, state: tuple[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """As GatedDeltaNet.forward: the step's tokens, this layer's state pool, each sequence's slot."""
        (pool,) = state
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)
        gated = b * x
        slots, num_decodes = meta.state_slots, meta.num_decode_tokens
        out = torch.empty_like(gated)
        if num_decodes:
            out[:num_decodes] = conv_decode(gated[:num_decodes], self.conv_weight, self.conv_bias, pool,
                                            slots[:num_decodes], meta.decode_context_lens == 1)
        if meta.prefills:
            convolved = conv_prefill(gated, self.conv_weight, self.conv_bias, pool, slots[num_decodes:], meta.prefills)
            for row, chunk in enumerate(meta.prefills):
                out[chunk.query_start : chunk.query_start + chunk.query_len] = convolved[row, : chunk.query_len]
        return self.out_proj(c * out)
