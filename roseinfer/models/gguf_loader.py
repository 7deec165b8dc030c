"""GGUF (llama.cpp's format) -> ModelConfig (each family's model class reads its own metadata) and
Hugging Face-named checkpoint tensors: dense ones as torch tensors, quantized ones as
`BlockTensor`s in their own type (or expanded to float32 for tools that want plain values).

llama.cpp's converter permutes the rows of Llama q/k weights for its interleaved rotary layout;
we undo that so one model implementation serves GGUF and Hugging Face checkpoints alike (on
blocks, a permutation of whole rows; the model's own re-interleaving then undoes it for free).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from roseinfer.config import ModelConfig
from roseinfer.errors import ModelLoadError
from roseinfer.layers.quantization import permute_rows
from roseinfer.layers.quantization.gguf import BlockTensor
from roseinfer.models.checkpoint_config import GGUFConfigSource
from roseinfer.models.gguf_file import GGUFFile
from roseinfer.models.registry import GGUF_ARCHITECTURES, GGUF_EXPERT_ARCHITECTURES, model_class_for

_ROPE_FACTOR_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_PERMUTED_QK = ("llama", "mistral", "granitehybrid", "nemotron_h")  # the converter's convention for these files' q/k rows
# Tensor names: each model class's gguf_layer_names / gguf_global_names (models/llama.py, ...).


def unpermute_qk(weight: torch.Tensor | BlockTensor, num_heads: int) -> torch.Tensor | BlockTensor:
    """Inverse of llama.cpp's row permutation of q/k (interleaved pairs -> rotate-half halves)."""

    def unpermute(rows: torch.Tensor) -> torch.Tensor:
        half = rows.shape[0] // num_heads // 2
        return rows.reshape(num_heads, half, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)

    return permute_rows(weight, unpermute)


def model_config_from_gguf(gguf: GGUFFile) -> ModelConfig:
    """The file's architecture looked up in the registry, and the model class of that family
    reading its metadata (`config_from_gguf`, in the model's own file)."""
    arch = gguf.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    architecture = GGUF_ARCHITECTURES[arch]
    # llama.cpp writes some mixture-of-experts models under a dense architecture's name (Mixtral
    # as `llama`): such a file that counts experts is read by the class that has them.
    if arch in GGUF_EXPERT_ARCHITECTURES and int(gguf.metadata.get(f"{arch}.expert_count") or 0):
        architecture = GGUF_EXPERT_ARCHITECTURES[arch]
    reader = getattr(model_class_for(architecture), "config_from_gguf", None)
    if reader is None:
        raise ModelLoadError(f"{gguf.path}: GGUF architecture {arch!r} ({architecture}) has no config reader here")
    return reader(GGUFConfigSource(gguf, architecture))


def _expert_slices(
    tensor: torch.Tensor | BlockTensor, shape: tuple[int, ...], layer: str, projections: tuple[str, ...],
    suffix: str = "weight",
) -> Iterator[tuple[str, torch.Tensor | BlockTensor]]:
    """A 3-D [experts, rows, columns] expert tensor (or a 2-D [experts, rows] bias: gpt-oss) as one
    tensor per expert (and projection, for a fused gate/up), under Hugging Face names: views of the
    same bytes, blocks kept as they are."""
    num_experts, rows = shape[0], shape[1]
    part_rows = rows // len(projections)
    for expert in range(num_experts):
        for index, projection in enumerate(projections):
            start = expert * rows + index * part_rows
            if isinstance(tensor, BlockTensor):
                part = tensor.narrow(0, start, part_rows)
            else:
                part = tensor.reshape(num_experts * rows, -1)[start:start + part_rows]
                if len(shape) == 2:  # a bias
                    part = part.reshape(part_rows)
            yield f"model.layers.{layer}.mlp.experts.{expert}.{projection}.{suffix}", part


def gguf_weights(
    gguf: GGUFFile, config: ModelConfig, expand: bool = False
) -> Iterator[tuple[str, torch.Tensor | BlockTensor]]:
    """Every tensor under its Hugging Face name, as stored (`expand`: as float32 values)."""
    arch = gguf.architecture
    model_class = model_class_for(config.architecture)  # it knows its checkpoints' names
    per_layer, global_names = model_class.gguf_layer_names, model_class.gguf_global_names
    expert_tensors: dict[str, tuple[str, ...]] = getattr(model_class, "gguf_expert_tensors", {})
    layer_prefix = model_class.gguf_layer_prefix
    for name in gguf.tensor_names():
        if name in _ROPE_FACTOR_TENSORS:
            continue  # part of the rotary scaling in the config
        stem, _, suffix = name.rpartition(".")  # suffix: weight | bias
        if suffix not in ("weight", "bias"):  # a bare parameter (Qwen3.5's blk.N.ssm_a)
            stem, suffix = name, ""
        parts = stem.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in expert_tensors:
            tensor = gguf.load_tensor(name) if expand else gguf.tensor(name)
            yield from _expert_slices(tensor, gguf.tensor_shape(name), parts[1], expert_tensors[parts[2]], suffix)
            continue
        module = ".".join(parts[2:])  # a layer's tensor: attn_q, or shortconv.in_proj (LFM2)
        if parts[0] == "blk" and len(parts) >= 3 and module in per_layer:
            hf_name = f"{layer_prefix}.{parts[1]}.{per_layer[module]}" + (f".{suffix}" if suffix else "")
        elif stem in global_names:
            hf_name, module = f"{global_names[stem]}.{suffix}", stem
        else:
            raise ModelLoadError(f"{gguf.path}: unexpected tensor {name!r} for architecture {arch!r}")
        tensor = gguf.load_tensor(name) if expand else gguf.tensor(name)
        if arch in _PERMUTED_QK and module in ("attn_q", "attn_k"):
            heads = config.num_heads if module == "attn_q" else config.num_kv_heads
            tensor = unpermute_qk(tensor, heads)
        if arch == "gpt2" and suffix == "weight" and module in ("attn_qkv", "attn_output", "ffn_up", "ffn_down"):
            tensor = tensor.t()  # Hugging Face's GPT-2 keeps these as Conv1D [in, out]
        yield hf_name, tensor

