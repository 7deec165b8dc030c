"""WeightLoader: each module is reported once all of its parameters are loaded (fused matrices
after their last shard), the loader lets go of a reported module's parameters, and missing or
repeated tensors are named."""

import gc
import weakref

import pytest
import torch
from torch import nn

from roseinfer.errors import ModelLoadError
from roseinfer.models.weights import WeightLoader


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(4, 6, bias=True)  # filled from two shards, then a bias
        self.norm = nn.LayerNorm(4)


def test_modules_are_reported_when_complete_and_then_let_go():
    model = Tiny()
    reported: list[str] = []
    old_weight = weakref.ref(model.qkv.weight)

    def replace(name: str, blocks: dict) -> None:
        assert blocks == {}  # dense tensors: nothing kept in blocks
        reported.append(name)
        if name == "qkv":  # as the engine does: the layer swapped for another holding a copy
            model.qkv = nn.Identity()

    loader = WeightLoader(model, replace)
    loader.load_rows("qkv.weight", torch.ones(3, 4), 0)
    loader.load("norm.weight", torch.ones(4))
    assert reported == []
    loader.load_rows("qkv.weight", torch.ones(3, 4), 3)
    assert reported == []  # the bias is still missing
    loader.load("qkv.bias", torch.zeros(6))
    assert reported == ["qkv"]
    loader.load("norm.bias", torch.zeros(4))
    assert reported == ["qkv", "norm"]
    loader.check_complete()
    gc.collect()
    assert old_weight() is None  # nothing of the loader kept the replaced weight alive
    with pytest.raises(ModelLoadError, match="'qkv.bias' twice"):
        loader.load("qkv.bias", torch.zeros(6))


def test_missing_and_unknown_tensors_are_named():
    loader = WeightLoader(Tiny(), lambda name: None)
    loader.load("qkv.weight", torch.ones(6, 4))
    loader.load_rows("norm.weight", torch.ones(2), 0)  # half of it
    with pytest.raises(ModelLoadError, match="lacks 3 tensor.*qkv.bias, norm.weight, norm.bias"):
        loader.check_complete()
    with pytest.raises(ModelLoadError, match="'lm_head.weight' that the model does not use"):
        loader.load("lm_head.weight", torch.ones(2, 4))
