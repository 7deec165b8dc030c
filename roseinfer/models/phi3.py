"""Phi-3, Phi-3.5 and Phi-4-mini: the Llama decoder with LongRoPE and partial rotary (both in
layers/rotary.py, from the config), whose checkpoints keep q/k/v and gate/up fused.

Our Llama model fuses the same matrices, but shards them per rank and puts q/k rows in its rotary
layout, so the fused checkpoint tensors are split at load into the Llama names (`narrow` on rows:
a view of a dense tensor, or the same rows of GGUF blocks kept in their own type) and loaded as a
Llama checkpoint's would be.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch

from roseinfer.errors import ModelLoadError
from roseinfer.models.checkpoint_config import HFConfigSource
from roseinfer.models.llama import LlamaForCausalLM
from roseinfer.models.weights import ModuleLoaded

# llama.cpp's `phi3` tensor names -> Hugging Face's, per layer (ffn_up holds gate and up).
PHI3_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}


class Phi3ForCausalLM(LlamaForCausalLM):
    hf_model_types: ClassVar[dict[str, str]] = {"phi3": "phi3"}
    gguf_architectures: ClassVar[dict[str, str]] = {"phi3": "phi3"}
    gguf_layer_names: ClassVar[dict[str, str]] = PHI3_GGUF_NAMES

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], on_module_loaded: ModuleLoaded | None = None
    ) -> None:
        super().load_weights(self._split_fused(weights), on_module_loaded)

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        config = self.config
        q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        splits = {  # fused module -> its parts (Hugging Face Llama names), in row order
            "qkv_proj": (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)),
            "gate_up_proj": (("gate_proj", config.intermediate_size), ("up_proj", config.intermediate_size)),
        }
        for name, tensor in weights:
            parts = name.split(".")
            split = splits.get(parts[-2]) if len(parts) > 1 else None
            if split is None:
                yield name, tensor
                continue
            expected = sum(rows for _, rows in split)
            if tensor.shape[0] != expected:
                raise ModelLoadError(f"tensor {name!r} has {tensor.shape[0]} rows, the model expects {expected}")
            start = 0
            for module, rows in split:
                parts[-2] = module
                yield ".".join(parts), tensor.narrow(0, start, rows)
                start += rows

    @classmethod
    def hf_rope(cls, source: HFConfigSource) -> tuple[float, dict[str, Any] | None, float]:
        # transformers reads Phi-3's old "yarn" configs as LongRoPE, and its original context is
        # 4096 where config.json does not give it.
        return source.rope(legacy_yarn_as="longrope", default_original_positions=4096)
