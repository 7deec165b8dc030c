"""Recurrences: layer kinds that keep a fixed-size state per sequence instead of a growing KV cache
(Gated DeltaNet, LFM2's short convolution, Mamba2). A recurrence is one module here plus a
registry entry: its layer class, built from its own parameters dataclass, with a `state_tensors`
static method giving one sequence's state (spec.py). The model runner allocates each recurrent
layer's pool from `recurrent_state_spec`, and a step's metadata gives each sequence's slot
(`AttentionMetadata.state_slots`); nothing above this package knows which recurrence runs."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from roseinfer.layers.recurrent.gated_delta_net import GatedDeltaNet, GatedDeltaNetParams
from roseinfer.layers.recurrent.mamba2 import Mamba2Mixer, Mamba2Params
from roseinfer.layers.recurrent.short_conv import ShortConv, ShortConvParams
from roseinfer.layers.recurrent.spec import RecurrentStateSpec, StateTensorSpec

RECURRENCES: dict[str, type[nn.Module]] = {
    GatedDeltaNet.kind: GatedDeltaNet,
    ShortConv.kind: ShortConv,
    Mamba2Mixer.kind: Mamba2Mixer,
}


def recurrence_class(kind: str) -> type[nn.Module]:
    layer_class = RECURRENCES.get(kind)
    if layer_class is None:
        raise ValueError(f"recurrence {kind!r} is not supported; supported: {sorted(RECURRENCES)}")
    return layer_class


def recurrent_state_spec(kind: str, params: object, layers: Sequence[int]) -> RecurrentStateSpec:
    """The state group of `layers`, each running recurrence `kind` with `params`."""
    return RecurrentStateSpec(kind, tuple(layers), recurrence_class(kind).state_tensors(params))


__all__ = ["RECURRENCES", "GatedDeltaNetParams", "Mamba2Params", "RecurrentStateSpec", "ShortConvParams", "StateTensorSpec",
           "recurrence_class", "recurrent_state_spec"]
