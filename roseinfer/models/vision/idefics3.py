"""Idefics3 / SmolVLM's image encoder: each image arrives as tiles (the processor splits a large
image into a grid of `image_size` squares plus one downscaled global view); each tile goes
through the SigLIP tower, then a pixel shuffle folds every `scale_factor` x `scale_factor`
patches into one token and a linear projection maps it to the text model's width. A tile of
512 x 512 pixels in patches of 16 with a scale factor of 4 becomes 64 tokens."""

from __future__ import annotations

import torch
from torch import nn

from roseinfer.models.vision.siglip import SiglipConfig, SiglipVisionTransformer


class Idefics3ModalityProjection(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features, bias=False)


class Idefics3Connector(nn.Module):
    def __init__(self, vision_width: int, text_width: int, scale_factor: int) -> None:
        super().__init__()
        self.scale_factor = scale_factor
        self.modality_projection = Idefics3ModalityProjection(vision_width * scale_factor**2, text_width)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[tiles, side * side, width] -> [tiles, (side / s)^2, width * s^2] -> projected. The
        s x s patches that become one token are neighbours in the image, in row-major order."""
        tiles, count, width = patches.shape
        side, s = int(count**0.5), self.scale_factor
        grid = patches.view(tiles, side // s, s, side // s, s, width)  # [t, row block, row, col block, col, w]
        # one token per (row block, col block): its s x s patches side by side, row by row
        folded = grid.permute(0, 1, 3, 2, 4, 5).reshape(tiles, (side // s) ** 2, s * s * width)
        return self.modality_projection.proj(folded)


class Idefics3VisionEncoder(nn.Module):
    """`encode(pixel_values [tiles, C, H, W], pixel_attention_mask [tiles, H, W] | None)` -> the
    image's token embeddings [tiles * tokens_per_tile, text_width], in the order of its
    placeholder tokens."""

    family = "idefics3"

    def __init__(self, vision: SiglipConfig, text_width: int, scale_factor: int) -> None:
        super().__init__()
        self.vision_config = vision
        self.vision_model = SiglipVisionTransformer(vision)
        self.connector = Idefics3Connector(vision.hidden_size, text_width, scale_factor)

    @classmethod
    def from_hf_config(cls, config: dict) -> Idefics3VisionEncoder:
        return cls(SiglipConfig.from_hf(config["vision_config"]), config["text_config"]["hidden_size"],
                   config.get("scale_factor", 2))

    @property
    def tokens_per_tile(self) -> int:
        return self.vision_config.patches_per_side**2 // self.connector.scale_factor**2

    def _positions(self, patch_mask: torch.Tensor) -> torch.Tensor:
        """Each real patch's position embedding: its fractional place in the tile's real patches,
        bucketed into the tower's grid (a tile smaller than the grid is spread over it)."""
        per_side = self.vision_config.patches_per_side
        tiles, rows, cols = patch_mask.shape
        # float boundaries and coordinates, as the checkpoints' own code computes them: the
        # buckets of coordinates that fall on a boundary depend on its rounding
        boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side)

        def buckets(count: int, real: torch.Tensor) -> torch.Tensor:
            fraction = torch.arange(count, dtype=torch.float32)[None, :] / real[:, None].float()
            return torch.bucketize(fraction.clamp(max=1.0 - 1e-6), boundaries, right=True)

        bucket_row = buckets(rows, patch_mask[:, :, 0].sum(1).clamp(min=1))
        bucket_col = buckets(cols, patch_mask[:, 0, :].sum(1).clamp(min=1))
        positions = bucket_row[:, :, None] * per_side + bucket_col[:, None, :]
        return torch.where(patch_mask, positions, 0).view(tiles, -1)

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        patch = self.vision_config.patch_size
        tiles, _, height, width = pixel_values.shape
        if pixel_attention_mask is None:
            patch_mask = torch.ones(tiles, height // patch, width // patch, dtype=torch.bool)
        else:
            patch_mask = pixel_attention_mask.view(tiles, height // patch, patch, width // patch, patch).any(4).any(2)
        hidden = self.vision_model(pixel_values, self._positions(patch_mask), patch_mask.view(tiles, -1))
        return self.connector(hidden).reshape(-1, self.connector.modality_projection.proj.out_features)
