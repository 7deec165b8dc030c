"""Nemotron-H (NVIDIA, transformers' `nemotron_h`, llama.cpp's `nemotron_h`): a hybrid of single-mixer
blocks, in plain PyTorch. Each block is an RMSNorm, one mixer and a residual add; the mixer is a
Mamba2 layer (layers/recurrent/mamba2.py: a state per sequence in a pool slot), Llama attention
without a rotary embedding, or an MLP of ReLU² (up, relu(x)², down; no gate). The checkpoint's
`hybrid_override_pattern` spells the blocks M, * and - (transformers 5: layers_block_type).

The mixture-of-experts variant (Nemotron 3 Nano: E blocks, a sigmoid router with group-limited
choice and a latent projection) is not run here yet; its checkpoints are refused at load. Every
block keeps a KV pool of the engine's, used only by the attention blocks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from roseinfer.config import ModelConfig, RecurrentConfig
from roseinfer.errors import ModelLoadError
from roseinfer.layers.attention import AttentionMetadata
from roseinfer.layers.norm import RMSNorm
from roseinfer.layers.parallel import VocabParallelEmbedding
from roseinfer.layers.recurrent import Mamba2Params, recurrence_class
from roseinfer.models.checkpoint_config import GGUFConfigSource, HFConfigSource
from roseinfer.models.decoder import CausalLM
from roseinfer.models.llama import LlamaAttention
from roseinfer.models.weights import ModuleLoaded, WeightLoader, dense

_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention", "full_attention": "attention",
          "mlp": "mlp", "moe": "moe"}


class NoPEAttention(LlamaAttention):
    """Llama's attention (grouped KV heads, head_dim ** -0.5) with no positional rotation."""

    def forward(
        self, hidden: torch.Tensor, rotations: torch.Tensor | None, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out = self.attn(q.view(num_tokens, self.num_heads, self.head_dim),
                        k.view(num_tokens, self.num_kv_heads, self.head_dim),
                        v.view(num_tokens, self.num_kv_heads, self.head_dim), kv_cache, meta)
        return self.o_proj(out.view(num_tokens, self.q_size))


class ReluSquaredMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class NemotronHBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        recurrent, kind = config.recurrent, config.family_options["blocks"][layer]
        assert recurrent is not None
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.kind = kind
        if kind == "mamba":
            self.mixer: nn.Module = recurrence_class(recurrent.kind)(recurrent.params)
        elif kind == "attention":
            self.mixer = NoPEAttention(config, layer)
        else:
            self.mixer = ReluSquaredMLP(config.hidden_size, config.intermediate_size,
                                        config.family_options.get("mlp_bias", False))

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, cache: Any, meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this block's output before its residual add, the residual); `cache`: the block's KV
        pool (attention), its state pools (Mamba2), or unused (MLP)."""
        hidden, residual = self.norm.add_and_norm(hidden, residual)
        if self.kind == "mamba":
            return self.mixer(hidden, cache, meta), residual
        if self.kind == "attention":
            return self.mixer(hidden, None, cache, meta), residual
        return self.mixer(hidden), residual


class NemotronHBackbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(NemotronHBlock(config, i) for i in range(config.num_layers))
        self.norm_f = RMSNorm(config.hidden_size, config.norm_eps)


class NemotronHForCausalLM(CausalLM):
    hf_model_types: ClassVar[dict[str, str]] = {"nemotron_h": "nemotron_h"}
    gguf_architectures: ClassVar[dict[str, str]] = {"nemotron_h": "nemotron_h"}
    gguf_layer_prefix: ClassVar[str] = "backbone.layers"
    gguf_layer_names: ClassVar[dict[str, str]] = {
        "attn_norm": "norm",
        "attn_q": "mixer.q_proj",
        "attn_k": "mixer.k_proj",
        "attn_v": "mixer.v_proj",
        "attn_output": "mixer.o_proj",
        "ffn_up": "mixer.up_proj",
        "ffn_down": "mixer.down_proj",
        "ssm_in": "mixer.in_proj",
        "ssm_conv1d": "mixer.conv1d",
        "ssm_dt": "mixer.dt",  # .bias: dt_bias
        "ssm_a": "mixer.ssm_a",  # -exp(A_log)
        "ssm_d": "mixer.D",
        "ssm_norm": "mixer.norm",
        "ssm_out": "mixer.out_proj",
    }
    gguf_global_names: ClassVar[dict[str, str]] = {
        "token_embd": "backbone.embeddings", "output_norm": "backbone.norm_f", "output": "lm_head",
    }

    def __init__(self, config: ModelConfig) -> None:
        if config.recurrent is None or "blocks" not in config.family_options:
            raise ModelLoadError("Nemotron-H needs its block kinds (family_options['blocks']) and Mamba2 layers")
        super().__init__(config)
        self.backbone = NemotronHBackbone(config)
        self.add_lm_head(self.backbone.embeddings)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[Any], meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] (no positions: the attention has no rotary embedding)."""
        hidden, residual = self.backbone.embeddings(input_ids), None
        for layer, cache in zip(self.backbone.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cache, meta)
        return self.backbone.norm_f.add_and_norm(hidden, residual)[0]

    def load_weights(self, weights: Iterable[tuple[str, Any]], on_module_loaded: ModuleLoaded | None = None) -> None:
        """Hugging Face-named tensors (or GGUF ones under those names, see gguf_layer_names): q/k/v
        fused, the Mamba2 parameters as Mamba2Mixer keeps them."""
        loader = WeightLoader(self, on_module_loaded)
        for name, tensor in weights:
            if self.skips_tensor(name) or name.startswith("mtp."):  # mtp.: the MTP head (not run yet)
                continue
            parts = name.split(".")
            if parts[:2] == ["backbone", "layers"] and parts[3] == "mixer":
                self._load_mixer(loader, ".".join(parts[:4]), ".".join(parts[4:]), tensor)
            elif name in ("backbone.embeddings.weight", "lm_head.weight"):
                loader.load(name, self.vocab.of(tensor))
            else:
                loader.load(name, tensor)
        self.finish_load(loader, self.backbone.embeddings)

    def _load_mixer(self, loader: WeightLoader, prefix: str, leaf: str, tensor: Any) -> None:
        mixer = self.get_submodule(prefix)
        values = dense(tensor)
        if leaf in ("q_proj.weight", "k_proj.weight", "v_proj.weight"):
            first = {"q": 0, "k": mixer.q_size, "v": mixer.q_size + mixer.kv_size}[leaf[0]]
            loader.load_rows(f"{prefix}.qkv_proj.weight", tensor, first)
        elif leaf == "conv1d.weight":
            loader.load(f"{prefix}.conv_weight", values.reshape(values.shape[0], -1))
        elif leaf == "conv1d.bias":
            loader.load(f"{prefix}.conv_bias", values)
        elif leaf == "A_log":
            loader.load(f"{prefix}.decay_rate", -values.float().exp())
        elif leaf == "ssm_a":  # GGUF: -exp(A_log) already
            loader.load(f"{prefix}.decay_rate", values.reshape(-1))
        elif leaf == "D":
            loader.load(f"{prefix}.skip", values.reshape(-1))
        elif leaf == "dt.bias":
            loader.load(f"{prefix}.dt_bias", values)
        elif leaf == "norm.weight":  # GGUF: [groups, inner / groups]
            loader.load(f"{prefix}.norm_weight", values.reshape(-1))
        else:  # in_proj, out_proj, dt_bias, up_proj, down_proj, o_proj
            loader.load(f"{prefix}.{leaf}", tensor)

    # -- reading a checkpoint's config (models/hf_config.py and gguf_loader.py dispatch here) --

    @classmethod
    def config_from_hf(cls, source: HFConfigSource) -> ModelConfig:
        raw = source.raw
        pattern = raw.get("hybrid_override_pattern")
        if pattern is not None:
            unknown = sorted(set(pattern) - set(_PATTERN))
            kinds = [_PATTERN.get(symbol, symbol) for symbol in pattern]
        else:
            spelled = raw.get("layers_block_type") or raw.get("layer_types") or []
            unknown = sorted(set(spelled) - set(_KINDS))
            kinds = [_KINDS.get(kind, kind) for kind in spelled]
        if unknown or not kinds:
            raise source.error(f"block kinds {unknown or 'missing'} are not supported (Mamba2, attention, MLP)")
        if "moe" in kinds:
            raise source.error("Nemotron-H's mixture-of-experts blocks are not supported yet")
        if raw.get("mlp_hidden_act", "relu2") != "relu2":
            raise source.error(f"MLP activation {raw['mlp_hidden_act']!r} is not supported (relu2 only)")
        heads = raw["num_attention_heads"]
        eps = raw.get("layer_norm_epsilon", 1e-5)
        mamba_heads = raw.get("mamba_num_heads", 128)
        params = Mamba2Params(
            hidden_size=raw["hidden_size"], num_heads=mamba_heads, head_dim=raw.get("mamba_head_dim", 64),
            state_size=raw.get("ssm_state_size", 128), num_groups=raw.get("n_groups", raw.get("mamba_n_groups", 8)),
            conv_kernel=raw.get("conv_kernel", raw.get("mamba_d_conv", 4)), norm_eps=eps,
            conv_bias=bool(raw.get("use_conv_bias", raw.get("mamba_conv_bias", True))),
            proj_bias=bool(raw.get("use_bias", False)),
        )
        return source.build(
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], num_layers=len(kinds), num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw.get("attention_head_dim") or raw["hidden_size"] // heads,
            intermediate_size=raw["intermediate_size"], max_position_embeddings=raw.get("max_position_embeddings", 4096),
            norm_eps=eps, tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            family_options={"blocks": kinds, "mlp_bias": bool(raw.get("mlp_bias", False))},
            recurrent=RecurrentConfig("mamba2", tuple(i for i, kind in enumerate(kinds) if kind == "mamba"), params),
        )

    @classmethod
    def config_from_gguf(cls, source: GGUFConfigSource) -> ModelConfig:
        gguf, common = source.gguf, source.common
        layers = common["num_layers"]
        # Each block's kind from its tensors (the per-block head and FFN counts say the same).
        kinds = ["attention" if gguf.has_tensor(f"blk.{i}.attn_q.weight")
                 else "mlp" if gguf.has_tensor(f"blk.{i}.ffn_up.weight") else "mamba" for i in range(layers)]
        if gguf.has_tensor("blk.0.ffn_gate_inp.weight") or int(source.get("expert_count") or 0):
            raise source.error("Nemotron-H's mixture-of-experts blocks are not supported yet")
        head_dim = source.head_dim()
        attention = [i for i, kind in enumerate(kinds) if kind == "attention"]
        mlp = [i for i, kind in enumerate(kinds) if kind == "mlp"]
        heads = int(source.key("ssm.time_step_rank"))
        eps = float(source.key("attention.layer_norm_rms_epsilon", 1e-5))
        params = Mamba2Params(
            hidden_size=common["hidden_size"], num_heads=heads, head_dim=int(source.key("ssm.inner_size")) // heads,
            state_size=int(source.key("ssm.state_size")), num_groups=int(source.key("ssm.group_count")),
            conv_kernel=int(source.key("ssm.conv_kernel")), norm_eps=eps,
            conv_bias=any(gguf.has_tensor(f"blk.{i}.ssm_conv1d.bias") for i in range(layers)),
            proj_bias=any(gguf.has_tensor(f"blk.{i}.ssm_in.bias") for i in range(layers)),
        )
        return source.build(
            num_kv_heads=gguf.tensor_shape(f"blk.{attention[0]}.attn_k.weight")[0] // head_dim if attention else 1,
            head_dim=head_dim, norm_eps=eps,
            intermediate_size=gguf.tensor_shape(f"blk.{mlp[0]}.ffn_up.weight")[0] if mlp else 0,
            max_position_embeddings=min(common["max_position_embeddings"], 2**20),
            family_options={"blocks": kinds, "mlp_bias": any(gguf.has_tensor(f"blk.{i}.ffn_up.bias") for i in mlp)},
            recurrent=RecurrentConfig("mamba2", tuple(i for i, kind in enumerate(kinds) if kind == "mamba"), params),
        )

