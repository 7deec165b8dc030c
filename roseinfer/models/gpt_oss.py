"""gpt-oss (OpenAI's open-weight MoE) in plain PyTorch.

Against the Llama family (attention projections, rotary layout and block layout of llama.py) and
the mixture-of-experts decoders (the grouped expert loop of moe.py):
- attention sinks: a learned logit per query head joins each softmax's denominator
  (`PagedAttention(sinks=True)`, applied by every attention backend);
- sliding-window layers (128 tokens) alternating with full ones (`ModelConfig.layer_types`; the KV
  cache groups release a sliding layer's blocks behind its window);
- biases on q/k/v and o, on the router and on every expert's projections;
- the router picks the top k by logit and takes a softmax over those k;
- the experts' clamped SwiGLU: gate clamped above at `limit`, up on both sides, then
  (up + 1) * gate * sigmoid(alpha * gate);
- YaRN rotary scaling (layers/rotary.py), without transformers' truncation of its ramp.

Checkpoints: transformers 5 keeps each layer's experts stacked, `mlp.experts.gate_up_proj`
[experts, hidden, 2 x width] with gate and up columns interleaved (gate even, up odd) and
`down_proj` [experts, width, hidden], as x @ W; llama.cpp's converter splits them into
`ffn_{gate,up,down}_exps` (+ `.bias`) in nn.Linear's orientation, MXFP4 where the checkpoint's were.
Both become one `nn.Linear` pair per expert here (gate rows then up rows), so each runs in its own
weight format as moe.py's experts do. The released safetensors keep the experts as MXFP4
`*_blocks` and `*_scales`: expanded to float32 at load (`expand_mxfp4`).

Tensor parallelism is not supported for this family yet (the sinks and o bias would need cutting).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from roseinfer.config import ModelConfig, MoeConfig
from roseinfer.distributed.parallel_state import get_tp_group
from roseinfer.errors import ModelLoadError
from roseinfer.layers.attention import PagedAttention
from roseinfer.models.checkpoint_config import GGUFConfigSource, HFConfigSource
from roseinfer.models.fused_decode import DecodeModelSpec
from roseinfer.models.llama import LLAMA_GGUF_LAYER_NAMES, LlamaAttention, LlamaForCausalLM
from roseinfer.models.moe import SparseMoeBlock
from roseinfer.models.weights import ModuleLoaded

# transformers' GptOssConfig defaults, which llama.cpp hard-codes for the architecture too.
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0
LAYER_PERIOD = 2  # every second layer attends to the whole sequence, the others slide


class GptOssAttention(LlamaAttention):
    """Llama's attention with a bias on o and a sink logit per head."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=True)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, config.head_dim, config.head_dim**-0.5,
                                   sliding_window=config.layer_window(layer), sinks=True)


class ClampedSwiGLUExpert(nn.Module):
    """One expert: gate/up (fused rows, gate first) and down, all with biases."""

    def __init__(self, hidden_size: int, intermediate_size: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=True)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


class GptOssMoeBlock(SparseMoeBlock):
    """The router (with a bias; softmax over the top k logits) and the clamped-SwiGLU experts, run
    by SparseMoeBlock's grouped loop."""

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        moe = config.moe
        assert moe is not None
        self.tp = get_tp_group()
        self.top_k = moe.top_k
        self.norm_topk_prob = True
        self.gate = nn.Linear(config.hidden_size, moe.num_experts, bias=True)
        alpha, limit = moe.swiglu_alpha, moe.swiglu_limit if moe.swiglu_limit is not None else SWIGLU_LIMIT
        self.experts = nn.ModuleList(
            ClampedSwiGLUExpert(config.hidden_size, moe.intermediate_size, alpha, limit)
            for _ in range(moe.num_experts)
        )
        self.shared_expert = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, chosen = torch.topk(self.gate(x), self.top_k, dim=-1)
        return torch.softmax(logits, dim=-1), chosen

    def decode_spec(self):  # noqa: ANN201 - the fused step has no clamped SwiGLU or biases
        raise NotImplementedError("gpt-oss's experts do not run in the fused decode step")


# MXFP4's 4-bit values (e2m1): the low nibble of a byte is the first of its two values.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def expand_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The checkpoint's MXFP4 experts (`*_blocks` uint8 [experts, rows, groups, 16], two values a
    byte, and `*_scales` uint8 [experts, rows, groups], a power of two biased by 127 per 32 values)
    as float32 [experts, rows, groups x 32] (rows: the projection's outputs)."""
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack([table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]], dim=-1).flatten(-2)
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)


def _expert_names(weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
    """Hugging Face names as this model holds them: the router as `mlp.gate`, the sinks inside the
    attention layer, and transformers' stacked experts (dense, or MXFP4 blocks and scales as the
    released checkpoints keep them) as one gate/up/down (weight, bias) each."""
    pending: dict[str, torch.Tensor] = {}  # an MXFP4 tensor's blocks or scales, until the other comes
    for name, tensor in weights:
        name = name.replace(".mlp.router.", ".mlp.gate.").replace(".self_attn.sinks", ".self_attn.attn.sinks")
        name = name.removesuffix(".sinks.weight") + ".sinks" if name.endswith(".sinks.weight") else name
        prefix, found, leaf = name.rpartition(".mlp.experts.")
        if found and leaf.endswith(("_blocks", "_scales")):
            stem, _, part = name.rpartition("_")
            other = pending.pop(f"{stem}_{'scales' if part == 'blocks' else 'blocks'}", None)
            if other is None:
                pending[name] = tensor
                continue
            blocks, scales = (tensor, other) if part == "blocks" else (other, tensor)
            name, leaf = stem, stem.rpartition(".")[2]
            tensor = expand_mxfp4(blocks, scales).transpose(1, 2)  # as the dense checkpoints hold it: x @ W
        if found and leaf in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            base = f"{prefix}.mlp.experts"
            for expert, values in enumerate(tensor):
                if leaf == "down_proj":
                    yield f"{base}.{expert}.down_proj.weight", values.t()
                elif leaf == "down_proj_bias":
                    yield f"{base}.{expert}.down_proj.bias", values
                else:  # gate and up interleaved along the last axis (x @ W: columns are outputs)
                    kind = "weight" if leaf == "gate_up_proj" else "bias"
                    values = values.t() if kind == "weight" else values
                    yield f"{base}.{expert}.gate_proj.{kind}", values[0::2]
                    yield f"{base}.{expert}.up_proj.{kind}", values[1::2]
            continue
        yield name, tensor
    if pending:
        raise ModelLoadError(f"MXFP4 tensor(s) without their blocks or scales: {', '.join(sorted(pending))}")


class GptOssForCausalLM(LlamaForCausalLM):
    hf_model_types: ClassVar[dict[str, str]] = {"gpt_oss": "gpt_oss"}
    gguf_architectures: ClassVar[dict[str, str]] = {"gpt-oss": "gpt_oss"}
    gguf_layer_names: ClassVar[dict[str, str]] = {
        **LLAMA_GGUF_LAYER_NAMES,
        "post_attention_norm": "post_attention_layernorm",
        "attn_sinks": "self_attn.sinks",
        "ffn_gate_inp": "mlp.router",
    }
    gguf_expert_tensors: ClassVar[dict[str, tuple[str, ...]]] = {
        "ffn_gate_exps": ("gate_proj",),
        "ffn_up_exps": ("up_proj",),
        "ffn_down_exps": ("down_proj",),
    }

    def __init__(self, config: ModelConfig) -> None:
        if config.moe is None:
            raise ModelLoadError("gpt-oss needs its expert configuration (ModelConfig.moe)")
        if get_tp_group().size > 1:
            raise ModelLoadError("gpt-oss does not run under tensor parallelism yet (tensor_parallel_size 1)")
        super().__init__(config)
        for index, layer in enumerate(self.model.layers):
            layer.self_attn = GptOssAttention(config, index)
            layer.mlp = GptOssMoeBlock(config)

    def fused_decode_spec(self) -> DecodeModelSpec | None:
        return None  # sinks, biases and the clamped SwiGLU: op by op

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], on_module_loaded: ModuleLoaded | None = None
    ) -> None:
        """Hugging Face-named tensors (see `_expert_names`) through Llama's loop: q/k/v and each
        expert's gate/up fused, q/k rows (and biases) in the interleaved rotary layout; then the
        sinks handed to the attention."""
        super().load_weights(weights, on_module_loaded)
        for module in self.modules():
            if isinstance(module, PagedAttention):
                module.bind_sinks()

    def checkpoint_tensors(self, weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        return _expert_names(weights)

    def this_ranks_part(self, parts: list[str], tensor: Any) -> Any:
        return tensor  # one rank only (see __init__)

    # -- reading a checkpoint's config (models/hf_config.py and gguf_loader.py dispatch here) --

    @classmethod
    def config_from_hf(cls, source: HFConfigSource) -> ModelConfig:
        raw = source.raw
        layers = raw["num_hidden_layers"]
        theta, scaling, _ = source.rope()
        if scaling is not None and scaling.get("rope_type") == "yarn":
            scaling.setdefault("truncate", False)  # GptOssConfig's default
        moe = MoeConfig(
            num_experts=raw["num_local_experts"],
            top_k=raw["num_experts_per_tok"],
            intermediate_size=raw["intermediate_size"],
            norm_topk_prob=True,
            swiglu_limit=float(raw.get("swiglu_limit", SWIGLU_LIMIT)),
            swiglu_alpha=float(raw.get("swiglu_alpha", SWIGLU_ALPHA)),
        )
        return source.build(
            **source.decoder_fields(max_positions=131072),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=raw.get("attention_bias", True),
            sliding_window=raw.get("sliding_window"),
            layer_types=raw.get("layer_types") or _layer_types(layers),
            attention_sinks=True,
            moe=moe,
        )

    @classmethod
    def config_from_gguf(cls, source: GGUFConfigSource) -> ModelConfig:
        config = super().config_from_gguf(source)
        num_experts = int(source.key("expert_count"))
        scaling = config.rope_scaling
        if scaling is not None and scaling.get("rope_type") == "yarn":
            scaling = {**scaling, "truncate": False}  # as transformers' GptOssConfig, llama.cpp's YaRN
        moe = MoeConfig(
            num_experts=num_experts,
            top_k=int(source.key("expert_used_count")),
            intermediate_size=int(source.get("expert_feed_forward_length") or config.intermediate_size),
            norm_topk_prob=True,
            swiglu_limit=SWIGLU_LIMIT,
            swiglu_alpha=SWIGLU_ALPHA,
        )
        return dataclasses.replace(
            config, moe=moe, rope_scaling=scaling, attention_bias=True, attention_sinks=True,
            layer_types=_layer_types(config.num_layers) if config.sliding_window else None,
        )


def _layer_types(layers: int) -> list[str]:
    return ["sliding_attention" if (i + 1) % LAYER_PERIOD else "full_attention" for i in range(layers)]
