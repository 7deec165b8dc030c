"""Architecture name -> model class, and building a model with its weights on a device."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from roseinfer.config import ModelConfig
from roseinfer.errors import ModelLoadError
from roseinfer.layers.linear import prepare_linear_layers
from roseinfer.layers.parallel import store_embeddings_compactly
from roseinfer.models.gpt2 import GPT2LMHeadModel
from roseinfer.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "gpt2": GPT2LMHeadModel,
}


def build_model(
    config: ModelConfig,
    weights: Iterable[tuple[str, torch.Tensor]],
    device: torch.device,
    dtype: torch.dtype,
    quantization: str = "none",
) -> nn.Module:
    """Instantiate without initialising (meta tensors), fill every parameter from `weights`, then
    give the linear layers the kernels of the device and the quantization method."""
    model_class = MODEL_CLASSES.get(config.architecture)
    if model_class is None:
        raise ModelLoadError(
            f"architecture {config.architecture!r} is not supported; supported: {sorted(MODEL_CLASSES)}"
        )
    with torch.device("meta"):
        model = model_class(config).to(dtype)
    model = model.to_empty(device=device)
    model.load_weights(weights)
    if hasattr(model, "rotary"):
        model.rotary.to(device)
    model.requires_grad_(False)
    prepare_linear_layers(model, quantization, device)
    store_embeddings_compactly(model)  # after the LM head took its own copy of a tied table
    return model.eval()
