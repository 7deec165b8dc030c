"""Gemma 4 (text: the dense 31B and E2B/E4B, the 26B-A4B mixture of experts) in plain PyTorch.

What sets it apart from Gemma 2/3 (models/gemma.py), as transformers' Gemma4TextModel computes it:
- two kinds of layers with heads of their own shape: sliding-window layers (head_dim, 256 in the
  released models) and full-attention ones (global_head_dim, 512, with fewer KV heads and, where
  `attention_k_eq_v`, no v projection: the values are the keys before their norm and rotation);
  `ModelConfig.layer_kv_dims` gives the KV pools those shapes;
- queries and keys RMS-normed per head, values too (without a scale); attention not scaled (1.0);
- rotary per kind: the sliding layers' default rope, the full layers' "proportional" rope (the
  first quarter of the frequency pairs of a 512-wide head turn, the others stay: angle 0);
- KV shared across layers: the last `num_kv_shared_layers` layers compute no keys or values and
  attend over those of the last earlier layer of their kind (`ModelConfig.kv_shared_layers`: they
  read that layer's pool and own none); with `use_double_wide_mlp` their MLPs are twice as wide;
- per-layer embeddings (E2B/E4B): a second token table gives each layer a small vector per token,
  mixed with a projection of the embeddings, which gates a residual branch after the MLP;
- the mixture of experts (26B-A4B) runs beside the dense MLP of each layer: a router over the
  residual (RMS-normed without a scale, times a learned scale and hidden_size ** -0.5), softmax,
  top k renormalised, times a learned per-expert scale; GeGLU experts; each branch normed apart;
- RMSNorm weights applied as they are (not 1 + w as Gemma 2/3), each layer's output multiplied by
  a learned scalar, final logits soft-capped.

Checkpoints: a text checkpoint (`gemma4_text`) or the multimodal one (`gemma4`: the text model under
`model.language_model.`, configured by `text_config`), whose vision and audio towers are not loaded
(text only); and GGUF files of llama.cpp's converter (`gemma4`). Decode steps run op by op (no
fused C++ step describes this layout), on one rank (no tensor parallelism yet).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.config import ModelConfig, MoeConfig
from roseinfer.distributed.parallel_state import get_tp_group
from roseinfer.errors import ModelLoadError
from roseinfer.layers.activation import gelu_tanh_and_mul
from roseinfer.layers.attention import AttentionMetadata, PagedAttention
from roseinfer.layers.norm import RMSNorm
from roseinfer.layers.parallel import VocabParallelEmbedding, gather_logits
from roseinfer.layers.rotary import RotaryEmbedding, apply_rotary, interleave_rotary_rows
from roseinfer.models.checkpoint_config import GGUFConfigSource, HFConfigSource, eos_ids
from roseinfer.models.fused_decode import DecodeModelSpec
from roseinfer.models.weights import ModuleLoaded, WeightLoader

logger = logging.getLogger(__name__)

# The multimodal checkpoint's parts: the text model's prefix, and the towers this family skips.
TEXT_PREFIX = "model.language_model."
TOWER_PREFIXES = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")
FULL, SLIDING = "full_attention", "sliding_attention"


def rope_inverse_frequencies(head_dim: int, rope: dict[str, Any]) -> torch.Tensor:
    """[head_dim / 2] inverse frequencies of one kind of layer, as transformers' "default" and
    "proportional" ropes compute them: pair i turns at theta ** (-2i / head_dim) for the first
    `fraction` of the pairs, the rest not at all (0: exactly the identity)."""
    pairs = head_dim // 2
    rotated = int(rope.get("fraction", 1.0) * pairs)
    steps = torch.arange(0, 2 * rotated, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (float(rope["theta"]) ** (steps / head_dim))
    inv_freq = torch.cat([inv_freq, torch.zeros(pairs - rotated, device="cpu")]) / float(rope.get("factor", 1.0))
    return inv_freq


def _options(config: ModelConfig) -> dict[str, Any]:
    options = config.family_options
    if "rope" not in options:
        raise ModelLoadError("Gemma 4 needs its family options (rotary per kind of layer, MLP widths)")
    return options


class Gemma4Attention(nn.Module):
    """One layer's attention: q (and, unless it reads another layer's, k and v) projected in one
    matrix product, q/k/v normed per head, q/k rotated, attention over the paged pool unscaled."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads, self.head_dim = config.layer_kv_shape(layer)
        self.shares = config.kv_shared_layers.get(layer)  # the layer whose keys and values it reads
        self.is_shared = layer in config.kv_shared_layers.values()  # a later layer reads its keys and values
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = 0 if self.shares is not None else self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        # (with attention_k_eq_v the v rows hold k's weights as the checkpoint has them: values
        # are neither normed with k's weights nor rotated)
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.norm_eps)
        if self.shares is None:
            self.k_norm = RMSNorm(self.head_dim, config.norm_eps)
        self.eps = config.norm_eps
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, 1.0,
                                   sliding_window=config.layer_window(layer))

    def forward(
        self, hidden: torch.Tensor, rotations: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]], layer: int,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q = qkv[:, : self.q_size].view(tokens, self.num_heads, self.head_dim)
        q = apply_rotary(self.q_norm(q), rotations)
        if self.shares is None:
            k, v = qkv[:, self.q_size :].split([self.kv_size, self.kv_size], dim=-1)
            k = apply_rotary(self.k_norm(k.reshape(tokens, self.num_kv_heads, self.head_dim)), rotations)
            v = F.rms_norm(v.reshape(tokens, self.num_kv_heads, self.head_dim), (self.head_dim,), eps=self.eps)
            if self.is_shared:
                shared[layer] = (k, v)
        else:
            # This step's keys and values of the layer it reads, already in that layer's pool
            # (which is this layer's `kv_cache` too): the backend stores them again, unchanged.
            k, v = shared[self.shares]
        out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out.view(tokens, self.q_size))


class GeGLU(nn.Module):
    """GELU(tanh)(gate) * up, then down: a dense MLP or one expert (gate rows, then up rows)."""

    def __init__(self, hidden_size: int, width: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * width, bias=False)
        self.down_proj = nn.Linear(width, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma4Router(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        self.top_k = moe.top_k
        self.eps = config.norm_eps
        self.root = config.hidden_size**-0.5
        self.proj = nn.Linear(config.hidden_size, moe.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(moe.num_experts))

    def forward(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, top_k], expert ids [tokens, top_k]) of each token."""
        x = F.rms_norm(residual.float(), (residual.shape[-1],), eps=self.eps).to(residual.dtype)
        probs = torch.softmax(self.proj(x * self.scale * self.root).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights * self.per_expert_scale[chosen]).to(residual.dtype), chosen


def run_experts(experts: nn.ModuleList, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The chosen experts' weighted sum per token, as moe.py's blocks run theirs: tokens grouped by
    the expert they chose, one matrix product per chosen expert."""
    out = torch.zeros_like(x)
    top_k = chosen.shape[-1]
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    token_of, weight_of = order // top_k, weights.flatten()[order]
    start = 0
    for expert, count in enumerate(counts):
        if count:
            tokens = token_of[start : start + count]
            y = experts[expert](x.index_select(0, tokens))
            out.index_add_(0, tokens, y * weight_of[start : start + count, None])
            start += count
    return out


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        options = _options(config)
        hidden = config.hidden_size
        self.layer = layer
        self.is_sliding = config.layer_window(layer) is not None
        self.input_layernorm = RMSNorm(hidden, config.norm_eps)
        self.self_attn = Gemma4Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(hidden, config.norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, config.norm_eps)
        self.mlp = GeGLU(hidden, options["mlp_widths"][layer])
        self.post_feedforward_layernorm = RMSNorm(hidden, config.norm_eps)
        self.has_experts = config.moe is not None
        if self.has_experts:
            self.router = Gemma4Router(config)
            moe = config.moe
            self.experts = nn.ModuleList(GeGLU(hidden, moe.intermediate_size) for _ in range(moe.num_experts))
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, config.norm_eps)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, config.norm_eps)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, config.norm_eps)
        per_layer = options["per_layer_input_size"]
        if per_layer:
            self.per_layer_input_gate = nn.Linear(hidden, per_layer, bias=False)
            self.per_layer_projection = nn.Linear(per_layer, hidden, bias=False)
            self.post_per_layer_input_norm = RMSNorm(hidden, config.norm_eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))

    def forward(
        self, hidden: torch.Tensor, per_layer_input: torch.Tensor | None, rotations: torch.Tensor,
        kv_cache: torch.Tensor, meta: AttentionMetadata, shared: dict[int, tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        attention = self.self_attn(self.input_layernorm(hidden), rotations, kv_cache, meta, shared, self.layer)
        residual = hidden + self.post_attention_layernorm(attention)
        out = self.mlp(self.pre_feedforward_layernorm(residual))
        if self.has_experts:
            weights, chosen = self.router(residual)
            experts = run_experts(self.experts, self.pre_feedforward_layernorm_2(residual), weights, chosen)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(experts)
        hidden = residual + self.post_feedforward_layernorm(out)
        if per_layer_input is not None:
            gate = F.gelu(self.per_layer_input_gate(hidden), approximate="tanh") * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return hidden * self.layer_scalar


class Gemma4Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        options = _options(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        per_layer = options["per_layer_input_size"]
        if per_layer:
            width = config.num_layers * per_layer
            self.embed_tokens_per_layer = VocabParallelEmbedding(options["per_layer_vocab_size"], width)
            self.per_layer_model_projection = nn.Linear(config.hidden_size, width, bias=False)
            self.per_layer_projection_norm = RMSNorm(per_layer, config.norm_eps)


class Gemma4ForCausalLM(nn.Module):
    hf_model_types: ClassVar[dict[str, str]] = {"gemma4_text": "gemma4", "gemma4": "gemma4"}
    gguf_architectures: ClassVar[dict[str, str]] = {"gemma4": "gemma4"}
    gguf_layer_prefix: ClassVar[str] = "model.layers"
    # llama.cpp's tensor names -> Hugging Face's (per layer, then outside the layers).
    gguf_layer_names: ClassVar[dict[str, str]] = {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "post_ffw_norm": "post_feedforward_layernorm",
        "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
        "post_ffw_norm_1": "post_feedforward_layernorm_1",
        "post_ffw_norm_2": "post_feedforward_layernorm_2",
        "ffn_gate_inp": "router.proj",
        "ffn_gate_inp.scale": "router.scale",
        "ffn_down_exps.scale": "router.per_expert_scale",
        "inp_gate": "per_layer_input_gate",
        "proj": "per_layer_projection",
        "post_norm": "post_per_layer_input_norm",
        "layer_output_scale": "layer_scalar",
    }
    gguf_global_names: ClassVar[dict[str, str]] = {
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "output": "lm_head",
        "per_layer_token_embd": "model.embed_tokens_per_layer",
        "per_layer_model_proj": "model.per_layer_model_projection",
        "per_layer_proj_norm": "model.per_layer_projection_norm",
    }
    gguf_expert_tensors: ClassVar[dict[str, tuple[str, ...]]] = {
        "ffn_gate_up_exps": ("gate_up_proj",),
        "ffn_gate_exps": ("gate_proj",),
        "ffn_up_exps": ("up_proj",),
        "ffn_down_exps": ("down_proj",),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if get_tp_group().size > 1:
            raise ModelLoadError("Gemma 4 does not run under tensor parallelism yet (tensor_parallel_size 1)")
        options = _options(config)
        self.config = config
        self.tp = get_tp_group()
        self.model = Gemma4Backbone(config)
        self.vocab = self.model.embed_tokens.shard
        self.lm_head = nn.Linear(config.hidden_size, self.vocab.rows, bias=False)
        self.per_layer_input_size = options["per_layer_input_size"]
        sliding_dim = config.head_dim
        full_dim = next((config.layer_kv_shape(i)[1] for i in range(config.num_layers)
                         if config.layer_window(i) is None), sliding_dim)
        self.rotary_full = RotaryEmbedding(rope_inverse_frequencies(full_dim, options["rope"][FULL]))
        self.rotary_sliding = RotaryEmbedding(rope_inverse_frequencies(sliding_dim, options["rope"][SLIDING]))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        # sqrt(hidden) rounded to the weights' dtype first, as transformers does
        return hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor | None:
        """[tokens, layers, per_layer_input_size]: each layer's token vector (its own table row,
        scaled) mixed with a projection of the embeddings (scaled, RMS-normed)."""
        if not self.per_layer_input_size:
            return None
        model, size = self.model, self.per_layer_input_size
        rows = model.embed_tokens_per_layer(input_ids)
        rows = (rows * torch.tensor(size**0.5, dtype=rows.dtype)).view(len(input_ids), -1, size)
        projected = model.per_layer_model_projection(embeds) * self.config.hidden_size**-0.5
        projected = model.per_layer_projection_norm(projected.view(len(input_ids), -1, size))
        return (projected + rows) * 2.0**-0.5

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        per_layer = self.per_layer_inputs(input_ids, hidden)
        full, sliding = self.rotary_full.rotations(positions), self.rotary_sliding.rotations(positions)
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # this step's keys and values, by layer
        for index, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            hidden = layer(hidden, per_layer[:, index] if per_layer is not None else None,
                           sliding if layer.is_sliding else full, kv_cache, meta, shared)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = gather_logits(self.lm_head(hidden), self.config.vocab_size, self.tp)
        cap = self.config.final_logit_softcapping
        if logits is not None and cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def fused_decode_spec(self) -> DecodeModelSpec | None:
        return None  # per-layer head shapes, shared KV, per-layer inputs: op by op

    # -- weights ---------------------------------------------------------------------------

    def _hf_names(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Every tensor of the text model under the names this model holds (the multimodal
        checkpoint's text prefix dropped, its towers skipped; transformers' stacked experts and
        GGUF's expert slices as one gate_up/down per expert)."""
        towers = 0
        for name, tensor in weights:
            if name.startswith(TOWER_PREFIXES):
                towers += 1
                continue
            if name.startswith(TEXT_PREFIX):
                name = "model." + name.removeprefix(TEXT_PREFIX)
            name = name.replace(".mlp.experts.", ".experts.")  # GGUF's expert slices (gguf_loader)
            if name.endswith(".layer_scalar.weight"):
                name = name.removesuffix(".weight")
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):  # [experts, out, in]
                stem, _, leaf = name.rpartition(".")
                for expert, values in enumerate(tensor):
                    yield f"{stem}.{expert}.{leaf}.weight", values
                continue
            yield name, tensor
        if towers:
            logger.info("Gemma 4: the text model is loaded; %d tensors of its vision/audio towers are not", towers)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], on_module_loaded: ModuleLoaded | None = None
    ) -> None:
        """Hugging Face-named tensors: q/k/v fused (v from k where the checkpoint has none), gate
        and up fused, q/k rows and norms in the interleaved rotary layout."""
        config = self.config
        loader = WeightLoader(self, on_module_loaded)
        layers = self.model.layers
        for name, tensor in self._hf_names(weights):
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            parts = name.split(".")
            module = parts[-2] if len(parts) > 1 else ""
            layer = int(parts[2]) if name.startswith("model.layers.") else None
            if module in ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm"):
                attention = layers[layer].self_attn
                if attention.shares is not None and module in ("k_proj", "v_proj", "k_norm"):
                    continue  # a layer that reads another's keys and values uses none of its own
                if module in ("q_proj", "k_proj", "q_norm", "k_norm"):
                    heads = {"q_proj": attention.num_heads, "k_proj": attention.num_kv_heads}.get(module, 1)
                    rotated = interleave_rotary_rows(tensor, heads)
                else:
                    rotated = tensor
                if module in ("q_norm", "k_norm"):
                    loader.load(name, rotated)
                    continue
                fused = ".".join([*parts[:-2], "qkv_proj", parts[-1]])
                first = {"q_proj": 0, "k_proj": attention.q_size, "v_proj": attention.q_size + attention.kv_size}
                loader.load_rows(fused, rotated, first[module])
                if module == "k_proj" and config.layer_window(layer) is None and self._k_is_v:
                    loader.load_rows(fused, tensor, attention.q_size + attention.kv_size)  # unrotated
            elif module in ("gate_proj", "up_proj"):
                width = tensor.shape[0]
                parts[-2] = "gate_up_proj"
                loader.load_rows(".".join(parts), tensor, 0 if module == "gate_proj" else width)
            else:
                loader.load(name, tensor)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            loader.mark_loaded("lm_head.weight")
        loader.check_complete()

    @property
    def _k_is_v(self) -> bool:
        return bool(self.config.family_options.get("k_eq_v"))

    # -- reading a checkpoint's config (models/hf_config.py and gguf_loader.py dispatch here) --

    @classmethod
    def config_from_hf(cls, source: HFConfigSource) -> ModelConfig:
        raw = source.raw
        if source.model_type == "gemma4":  # the multimodal checkpoint: its text model's config
            text = raw.get("text_config") or {}
            eos = eos_ids(source.eos_token_ids, text.get("eos_token_id"))
            source = HFConfigSource({**text, "model_type": "gemma4_text"}, source.path, source.architecture, eos,
                                    source.name)
            raw = source.raw
        if raw.get("use_bidirectional_attention") == "all":
            raise source.error("use_bidirectional_attention 'all' (an embedding model) is not supported")
        activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise source.error(f"Gemma 4 activation {activation!r} is not supported (gelu_pytorch_tanh)")
        layers = raw["num_hidden_layers"]
        layer_types = list(raw.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(layers)])
        layer_types[-1] = FULL  # as Gemma4TextConfig forces it
        heads, kv_heads = raw["num_attention_heads"], raw.get("num_key_value_heads") or raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        k_eq_v = bool(raw.get("attention_k_eq_v", False))
        # The full layers' heads: per_layer_config (what transformers 5.2x writes), or
        # global_head_dim / num_global_key_value_heads (the released checkpoints' keys).
        per_layer = {int(k): v for k, v in (raw.get("per_layer_config") or {}).items()}
        dims: dict[int, tuple[int, int]] = {}
        for i, kind in enumerate(layer_types):
            if str(i) in (raw.get("per_layer_config") or {}) or i in per_layer:
                override = per_layer.get(i, {})
            elif kind == FULL:
                override = {"head_dim": raw.get("global_head_dim", 512)}
                if k_eq_v and raw.get("num_global_key_value_heads"):
                    override["num_key_value_heads"] = raw["num_global_key_value_heads"]
            else:
                override = {}
            shape = (override.get("num_key_value_heads", kv_heads), override.get("head_dim", head_dim))
            if shape != (kv_heads, head_dim):
                dims[i] = shape
        params = raw.get("rope_parameters") or {
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        }
        rope = {kind: _hf_rope(source, kind, params.get(kind) or {}) for kind in (FULL, SLIDING)}
        shared = _shared_layers(layer_types, int(raw.get("num_kv_shared_layers") or 0), source.error)
        width = raw["intermediate_size"]
        double = bool(raw.get("use_double_wide_mlp"))
        moe = None
        if raw.get("enable_moe_block"):
            moe = MoeConfig(num_experts=raw["num_experts"], top_k=raw["top_k_experts"],
                            intermediate_size=raw["moe_intermediate_size"], norm_topk_prob=True)
        per_layer_size = int(raw.get("hidden_size_per_layer_input") or 0)
        fields = source.decoder_fields(max_positions=131072, tied=True)
        return source.build(
            **fields,
            attention_bias=bool(raw.get("attention_bias", False)),
            qk_norm=True,
            hidden_act="gelu_pytorch_tanh",
            sliding_window=raw.get("sliding_window", 512),
            layer_types=layer_types,
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            moe=moe,
            layer_kv_dims=dims,
            kv_shared_layers=shared,
            family_options={
                "rope": rope,
                "k_eq_v": k_eq_v,
                "mlp_widths": [2 * width if double and i in shared else width for i in range(layers)],
                "per_layer_input_size": per_layer_size,
                "per_layer_vocab_size": int(raw.get("vocab_size_per_layer_input") or fields["vocab_size"]),
            },
        )

    @classmethod
    def config_from_gguf(cls, source: GGUFConfigSource) -> ModelConfig:
        gguf, common = source.gguf, source.common
        layers, heads = common["num_layers"], common["num_heads"]
        pattern = source.key("attention.sliding_window_pattern")
        if not isinstance(pattern, list):
            raise source.error("attention.sliding_window_pattern is not a per-layer list")
        layer_types = [SLIDING if slides else FULL for slides in pattern]
        kv_heads = source.key("attention.head_count_kv", heads)
        kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
        full_dim = int(source.key("attention.key_length"))
        sliding_dim = int(source.get("attention.key_length_swa") or full_dim)
        sliding_layer = layer_types.index(SLIDING) if SLIDING in layer_types else 0
        base = (int(kv_heads[sliding_layer]), sliding_dim)
        dims = {}
        for i, kind in enumerate(layer_types):
            shape = (int(kv_heads[i]), full_dim if kind == FULL else sliding_dim)
            if shape != base:
                dims[i] = shape
        shared = _shared_layers(layer_types, int(source.get("attention.shared_kv_layers") or 0), source.error)
        widths = source.key("feed_forward_length")
        widths = [int(w) for w in widths] if isinstance(widths, list) else [int(widths)] * layers
        # The full layers' proportional rope: llama.cpp's converter writes it as frequency divisors
        # (1 for the pairs that turn, 1e30 for the others).
        fraction = 1.0
        if gguf.has_tensor("rope_freqs.weight"):
            divisors = gguf.load_tensor("rope_freqs.weight")
            fraction = float((divisors < 1e20).sum()) / len(divisors)
        sliding_rot = int(source.get("rope.dimension_count_swa") or sliding_dim)
        rope = {
            FULL: {"theta": float(source.key("rope.freq_base", 1_000_000.0)), "fraction": fraction},
            SLIDING: {"theta": float(source.key("rope.freq_base_swa", 10_000.0)), "fraction": sliding_rot / sliding_dim},
        }
        own_full = [i for i, kind in enumerate(layer_types) if kind == FULL and i not in shared]
        k_eq_v = bool(own_full) and not gguf.has_tensor(f"blk.{own_full[0]}.attn_v.weight")
        moe = None
        if int(source.get("expert_count") or 0):
            moe = MoeConfig(num_experts=int(source.key("expert_count")), top_k=int(source.key("expert_used_count")),
                            intermediate_size=int(source.key("expert_feed_forward_length")), norm_topk_prob=True)
        per_layer_size = int(source.get("embedding_length_per_layer_input") or 0)
        per_layer_vocab = gguf.tensor_shape("per_layer_token_embd.weight")[0] if per_layer_size else 0
        # Instruct models end a turn with <turn|> (generation_config.json lists it beside <eos>);
        # the converter writes only <eos>.
        tokens = source.metadata.get("tokenizer.ggml.tokens") or []
        end_of_turn = [tokens.index("<turn|>")] if "<turn|>" in tokens else []
        return source.build(
            num_kv_heads=base[0],
            head_dim=sliding_dim,
            norm_eps=float(source.key("attention.layer_norm_rms_epsilon", 1e-6)),
            eos_token_ids=list(dict.fromkeys(common["eos_token_ids"] + end_of_turn)),
            intermediate_size=widths[0],
            attention_bias=gguf.has_tensor("blk.0.attn_q.bias"),
            qk_norm=True,
            hidden_act="gelu_pytorch_tanh",
            sliding_window=int(source.key("attention.sliding_window")),
            layer_types=layer_types,
            final_logit_softcapping=source.get("final_logit_softcapping"),
            moe=moe,
            layer_kv_dims=dims,
            kv_shared_layers=shared,
            family_options={
                "rope": rope,
                "k_eq_v": k_eq_v,
                "mlp_widths": widths,
                "per_layer_input_size": per_layer_size,
                "per_layer_vocab_size": per_layer_vocab,
            },
        )


def _hf_rope(source: HFConfigSource, kind: str, params: dict[str, Any]) -> dict[str, float]:
    """One kind of layer's rotary parameters (theta, the fraction of pairs that turn, factor)."""
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "proportional"):
        raise source.error(f"Gemma 4 rope_type {rope_type!r} of the {kind} layers is not supported "
                           "(default, proportional)")
    default_theta = 1_000_000.0 if kind == FULL else 10_000.0
    return {
        "theta": float(params.get("rope_theta", default_theta)),
        # transformers' default rope turns every pair, whatever partial_rotary_factor says
        "fraction": float(params.get("partial_rotary_factor", 1.0)) if rope_type == "proportional" else 1.0,
        "factor": float(params.get("factor", 1.0)) if rope_type == "proportional" else 1.0,
    }


def _shared_layers(layer_types: list[str], num_shared: int, error) -> dict[int, int]:  # noqa: ANN001
    """The last `num_shared` layers -> the layer whose keys and values each reads: the last layer
    of its kind before them (as transformers' kv_sharing_modes)."""
    if not num_shared:
        return {}
    first = len(layer_types) - num_shared
    if first <= 0:
        raise error(f"num_kv_shared_layers {num_shared} leaves no layer that computes keys and values")
    shared = {}
    for layer in range(first, len(layer_types)):
        sources = [i for i in range(first) if layer_types[i] == layer_types[layer]]
        if not sources:
            raise error(f"layer {layer} ({layer_types[layer]}) shares keys and values, but no earlier layer of "
                        "its kind computes them")
        shared[layer] = sources[-1]
    return shared
