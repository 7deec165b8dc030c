"""Architecture name -> model class (the one place a family is registered), the checkpoint names
each class reads (its `hf_model_types` and `gguf_architectures`, gathered here for the loaders),
and building a model with its weights on a device."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from roseinfer.config import ModelConfig
from roseinfer.errors import ModelLoadError
from roseinfer.layers.linear import LinearLayerKernels, WeightParts, prepare_linear_layers
from roseinfer.layers.parallel import VocabParallelEmbedding
from roseinfer.layers.rotary import RotaryEmbedding
from roseinfer.models.gemma import GemmaForCausalLM
from roseinfer.models.gemma4 import Gemma4ForCausalLM
from roseinfer.models.gpt2 import GPT2LMHeadModel
from roseinfer.models.gpt_oss import GptOssForCausalLM
from roseinfer.models.granite_hybrid import GraniteHybridForCausalLM
from roseinfer.models.lfm2 import Lfm2ForCausalLM
from roseinfer.models.llama import LlamaForCausalLM
from roseinfer.models.moe import MoeForCausalLM
from roseinfer.models.nemotron_h import NemotronHForCausalLM
from roseinfer.models.phi3 import Phi3ForCausalLM
from roseinfer.models.qwen3_5 import Qwen35ForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "gpt2": GPT2LMHeadModel,
    "gemma2": GemmaForCausalLM,
    "gemma3": GemmaForCausalLM,
    "gemma4": Gemma4ForCausalLM,  # text: dense and MoE (models/gemma4.py)
    "phi3": Phi3ForCausalLM,
    "moe": MoeForCausalLM,
    "qwen3_5": Qwen35ForCausalLM,  # and Qwen3.5-MoE, Qwen3-Next
    "lfm2": Lfm2ForCausalLM,
    "granite_hybrid": GraniteHybridForCausalLM,  # Granite 4
    "nemotron_h": NemotronHForCausalLM,  # dense Nemotron-H (Mamba2, attention and MLP blocks)
    "gpt_oss": GptOssForCausalLM,
}


def _checkpoint_names(attribute: str) -> dict[str, str]:
    """A checkpoint's architecture name (Hugging Face model_type, GGUF general.architecture) ->
    ours, from every registered class's `attribute`."""
    names: dict[str, str] = {}
    for model_class in dict.fromkeys(MODEL_CLASSES.values()):
        for name, architecture in getattr(model_class, attribute, {}).items():
            if MODEL_CLASSES.get(architecture) is not model_class:
                raise AssertionError(f"{model_class.__name__}.{attribute}: {name!r} -> {architecture!r}, not its own")
            names[name] = architecture
    return names


HF_MODEL_TYPES = _checkpoint_names("hf_model_types")
GGUF_ARCHITECTURES = _checkpoint_names("gguf_architectures")
# GGUF architectures llama.cpp also writes a class's models under, told apart by an expert count.
GGUF_EXPERT_ARCHITECTURES = _checkpoint_names("gguf_expert_architectures")


def model_class_for(architecture: str) -> type[nn.Module]:
    model_class = MODEL_CLASSES.get(architecture)
    if model_class is None:
        raise ModelLoadError(
            f"architecture {architecture!r} is not supported; supported: {sorted(MODEL_CLASSES)}"
        )
    return model_class


def build_model(
    config: ModelConfig,
    weights: Iterable[tuple[str, object]],
    device: torch.device,
    dtype: torch.dtype,
    quantization: str = "auto",
) -> nn.Module:
    """Instantiate without initialising (meta tensors), fill every parameter from `weights` (dense
    tensors, or GGUF blocks kept as they are), then give the linear layers the kernels of the
    device, the weights' formats and the quantization method."""
    model_class = model_class_for(config.architecture)
    with torch.device("meta"):
        model = model_class(config).to(dtype)
    model = model.to_empty(device=device)
    linear_kernels = LinearLayerKernels(quantization, device)

    def convert_when_loaded(module_name: str, blocks: dict[str, WeightParts]) -> None:
        # A layer whose weight came in blocks gets its kernel as soon as it is complete (or is
        # expanded), and with --quantization int4/int8 each dense layer is quantized then and its
        # float weight freed: an int4 load peaked with the whole float32 model in memory. Dense
        # layers otherwise wait for the end (see LinearLayerKernels._dense). A tied head waits too:
        # it is tied at the end of the load.
        module = model.get_submodule(module_name)
        with torch.no_grad():
            if isinstance(module, VocabParallelEmbedding):
                if "weight" in blocks:
                    _load_table(module, blocks["weight"], linear_kernels, dtype, device)
            elif blocks or (linear_kernels.quantizes and module_name != "lm_head"):
                linear_kernels.prepare(model, module_name, blocks.get("weight"))

    model.load_weights(weights, convert_when_loaded)
    for value in vars(model).values():  # rotary tables (Gemma 3 has one per kind of layer)
        if isinstance(value, RotaryEmbedding):
            value.to(device)
    model.requires_grad_(False)
    tie_head_to_table_blocks(model, linear_kernels)
    prepare_linear_layers(model, quantization, device)  # what is left: dense layers, the head
    return model.eval()


def _load_table(table: VocabParallelEmbedding, parts: WeightParts, kernels: LinearLayerKernels,
                dtype: torch.dtype, device: torch.device) -> None:
    blocks = kernels.embedding_blocks(parts)
    if blocks is not None:
        table.use_blocks(blocks)
        return
    expanded = torch.cat([tensor.dequantize(dtype) for _, tensor in sorted(parts, key=lambda part: part[0])])
    table.weight.copy_(expanded.to(device))


def tie_head_to_table_blocks(model: nn.Module, kernels: LinearLayerKernels) -> bool:
    """A tied LM head of a table kept in blocks reads those blocks (`LinearLayerKernels.tied_head`)
    or, where it needs a dense copy, gets the table expanded. Returns whether the head reads the
    blocks."""
    head = getattr(model, "lm_head", None)
    if type(head) is not nn.Linear:
        return False
    table = next((m for m in model.modules() if isinstance(m, VocabParallelEmbedding) and m.blocks is not None
                  and m.weight is head.weight), None)
    if table is None:
        return False
    reader = kernels.tied_head(head, table.blocks)
    if reader is not None:
        model.lm_head = reader
        return True
    # Its own dense copy, prepared (or quantized) with the other layers.
    head.weight = nn.Parameter(table.blocks.dequantize(head.weight.dtype), requires_grad=False)
    return False
