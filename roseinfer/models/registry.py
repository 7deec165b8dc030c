"""Architecture name -> model class, and building a model with its weights on a device."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from roseinfer.config import ModelConfig
from roseinfer.errors import ModelLoadError
from roseinfer.layers.cpu_kernels import cpu_kernels
from roseinfer.layers.linear import BlockQuantLinear, LinearLayerKernels, prepare_linear_layers
from roseinfer.layers.parallel import VocabParallelEmbedding, store_embeddings_compactly
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
    linear_kernels = LinearLayerKernels(quantization, device)

    def quantize_when_loaded(module_name: str) -> None:
        # With --quantization each linear layer is quantized as soon as it is loaded and its float
        # weight freed: an int4 load peaked with the whole float32 model in memory (946 MiB, now
        # 558 for 403 loaded). Float layers wait for the end (a prepacked copy is as large as the
        # weight; made during the load, the freed weights' holes raised the float32 peak by ~40
        # MiB). The head waits too: a tied head is tied at the end of the load.
        if quantization != "none" and module_name != "lm_head":
            with torch.no_grad():
                linear_kernels.prepare(model, module_name)

    model.load_weights(weights, quantize_when_loaded)
    if hasattr(model, "rotary"):
        model.rotary.to(device)
    model.requires_grad_(False)
    share_tied_head_blocks(model, quantization, device)
    prepare_linear_layers(model, quantization, device)  # what is left: the head
    store_embeddings_compactly(model)  # after the LM head took its own copy of a tied table
    return model.eval()


def share_tied_head_blocks(model: nn.Module, quantization: str, device: torch.device) -> bool:
    """Let a tied LM head read its embedding's 8-bit blocks instead of a copy of its own, where
    the table is exactly such blocks (a GGUF Q8_0 table, as the default model's) and the CPU
    kernel multiplies them against float activations as fast as a prepacked float32 weight: the
    default model's float32 head was a 108 MiB copy of a table kept in 29 MiB. Same values; only
    the order of the sums differs. Returns whether it did."""
    head = getattr(model, "lm_head", None)
    if device.type != "cpu" or type(head) is not nn.Linear or head.bias is not None:
        return False
    if not (quantization in ("int4", "int8") or (quantization == "none" and head.weight.dtype == torch.float32)):
        return False  # bfloat16's head is a bfloat16 matrix product, faster than 8-bit blocks here
    kernels = cpu_kernels()
    if kernels is None or not kernels.q8_float_gemm():
        return False
    embedding = next(
        (m for m in model.modules() if isinstance(m, VocabParallelEmbedding) and m.weight is head.weight), None
    )
    if embedding is None or not embedding.store_as_8bit_blocks_if_exact():
        return False
    model.lm_head = BlockQuantLinear(head, bits=8, quantize_activations=False, blocks=(embedding.codes, embedding.scales))
    return True
