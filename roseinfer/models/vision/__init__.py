"""Vision encoders: an image's pixels in, the text model's embeddings for its placeholder tokens
out. One module per family; `VISION_ENCODERS` maps a family name (ModelConfig.vision.family) to it."""

from __future__ import annotations

from roseinfer.models.vision.idefics3 import Idefics3VisionEncoder

VISION_ENCODERS: dict[str, type] = {
    "idefics3": Idefics3VisionEncoder,  # Idefics3, SmolVLM
}
