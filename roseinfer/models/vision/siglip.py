"""A SigLIP vision transformer, the image tower of Idefics3 / SmolVLM and Gemma 3: patches of the
image embedded by a strided convolution, learned position embeddings, pre-norm encoder layers
(bidirectional attention, a GELU MLP) and a final LayerNorm.

Parameter names follow the Hugging Face checkpoints' (`embeddings.patch_embedding`,
`encoder.layers.N.self_attn.q_proj`, ...), so a checkpoint's tower loads by name. Matrix products
run in the tower's dtype (bfloat16 on CPUs with bfloat16 dot products: oneDNN), attention through
SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class SiglipConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    image_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    @classmethod
    def from_hf(cls, vision_config: dict) -> SiglipConfig:
        return cls(
            hidden_size=vision_config["hidden_size"], intermediate_size=vision_config["intermediate_size"],
            num_layers=vision_config["num_hidden_layers"], num_heads=vision_config["num_attention_heads"],
            patch_size=vision_config["patch_size"], image_size=vision_config["image_size"],
            num_channels=vision_config.get("num_channels", 3),
            layer_norm_eps=vision_config.get("layer_norm_eps", 1e-6),
            hidden_act=vision_config.get("hidden_act", "gelu_pytorch_tanh"),
        )

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


def _gelu(name: str):
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"vision activation {name!r} is not supported")


class SiglipEmbeddings(nn.Module):
    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size, config.patch_size)
        self.position_embedding = nn.Embedding(config.patches_per_side**2, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        return patches.flatten(2).transpose(1, 2) + self.position_embedding(position_ids)


class SiglipAttention(nn.Module):
    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        batch, length, width = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.num_heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)),
                                             attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, width))


class SiglipMLP(nn.Module):
    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = _gelu(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = SiglipAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = SiglipMLP(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), mask)
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(config) for _ in range(config.num_layers))


class SiglipVisionTransformer(nn.Module):
    """`forward(pixel_values [B, C, H, W], position_ids [B, patches], patch_mask [B, patches] bool)`
    -> [B, patches, hidden]: padded patches (mask False) are neither attended to nor meaningful."""

    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = SiglipEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor, position_ids: torch.Tensor,
                patch_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embeddings(pixel_values, position_ids)
        # Every patch attends to every real patch of its image; a full image needs no mask.
        mask = None if patch_mask is None or bool(patch_mask.all()) else patch_mask[:, None, None, :]
        for layer in self.encoder.layers:
            x = layer(x, mask)
        return self.post_layernorm(x)
