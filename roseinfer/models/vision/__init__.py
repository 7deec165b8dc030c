"""Vision encoders: an image's pixels in, the text model's embeddings for its placeholder tokens
out. One module per family; `VISION_ENCODERS` maps a checkpoint's architecture to it."""

from __future__ import annotations

from roseinfer.models.vision.idefics3 import Idefics3VisionEncoder

VISION_ENCODERS: dict[str, type] = {
    "Idefics3ForConditionalGeneration": Idefics3VisionEncoder,  # SmolVLM, Idefics3
}
