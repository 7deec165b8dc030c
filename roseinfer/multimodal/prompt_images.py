"""From the images of a chat to prompt tokens and encoder inputs, per model family.

The chat template writes one marker per image part (`<image>`); each marker's token is replaced
by the run the family's processor makes for that image (for Idefics3 / SmolVLM: a grid of tiles,
each `<fake_token_around_image><row_i_col_j>` then its `<image>` placeholders, and the global
view), and the image's pixels go with the request as an `ImageInput`. The processors are
transformers' own (its image processors, on Pillow): the resizing and tiling the checkpoint was
trained with. A new family is one class here and a registry entry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np

from roseinfer.common.messages import ImageInput
from roseinfer.errors import InvalidRequestError, ModelLoadError
from roseinfer.multimodal.media import LoadedImage
from roseinfer.tokenizer import Tokenizer

_IMAGE_PART_TYPES = ("image_url", "image", "input_image")


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in _IMAGE_PART_TYPES


def image_source(part: Any, field_name: str = "messages") -> str | bytes | None:
    """The image a message content part carries (a URL, a data URL or base64), None for any
    other part. The API fronts hand images over in OpenAI's shape ({"type": "image_url",
    "image_url": {"url": ...}}); offline callers may also use the Hugging Face shape
    ({"type": "image", "image": <url, data URL or bytes>})."""
    if not is_image_part(part):
        return None
    kind = part["type"]
    if kind == "image_url":
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, dict) else value
    else:
        url = part.get("image", part.get("url", part.get("image_url")))
    if not isinstance(url, str | bytes) or not url:
        raise InvalidRequestError(f"{field_name}: an {kind} part needs its image as a URL, a data URL or base64",
                                  field_name)
    return url


class PromptImageProcessor(ABC):
    """One family's images -> placeholder runs and pixel arrays."""

    marker_token_id: int  # what the chat template writes for each image part
    embed_token_id: int  # the placeholder positions that take the encoder's rows
    # The template reads every message's content as a list of parts (SmolVLM's): a plain string
    # message is handed to it as one text part.
    content_as_parts: bool = False

    @abstractmethod
    def expand(self, image: LoadedImage) -> tuple[list[int], dict[str, np.ndarray]]:
        """The image's run of prompt tokens, and its encoder inputs (`pixel_values`, ...)."""

    def splice(self, token_ids: list[int], images: list[LoadedImage], field_name: str) -> tuple[list[int], list[ImageInput]]:
        """`token_ids` with each image marker replaced by its image's run, and the images' inputs."""
        markers = [i for i, token in enumerate(token_ids) if token == self.marker_token_id]
        if len(markers) != len(images):
            raise InvalidRequestError(
                f"the chat template wrote {len(markers)} image marker(s) for {len(images)} image(s): "
                "this model's template does not place every image part", field_name,
            )
        result: list[int] = []
        inputs: list[ImageInput] = []
        start = 0
        for marker, image in zip(markers, images, strict=True):
            result.extend(token_ids[start:marker])
            run, arrays = self.expand(image)
            inputs.append(ImageInput(len(result), len(run), image.digest, self.embed_token_id,
                                     arrays["pixel_values"], arrays.get("pixel_attention_mask")))
            result.extend(run)
            start = marker + 1
        result.extend(token_ids[start:])
        return result, inputs


class Idefics3PromptImages(PromptImageProcessor):
    """Idefics3 and SmolVLM, through transformers' processor for the checkpoint directory."""

    content_as_parts = True

    def __init__(self, model_dir: Path, tokenizer: Tokenizer) -> None:
        try:
            from transformers import AutoProcessor
        except ImportError as exc:
            raise ModelLoadError(f"{model_dir} is a vision-language model: its image processor is transformers', "
                                 "which is not installed (pip install transformers)") from exc
        try:
            self.processor = AutoProcessor.from_pretrained(str(model_dir))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{model_dir}: the image processor could not be loaded ({exc})") from exc
        self.tokenizer = tokenizer
        self.marker_token_id = self.embed_token_id = self._token_id(self.processor.image_token)

    def _token_id(self, text: str) -> int:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ModelLoadError(f"the image token {text!r} is not one token of this tokenizer")
        return ids[0]

    def expand(self, image: LoadedImage) -> tuple[list[int], dict[str, np.ndarray]]:
        inputs = self.processor.image_processor(images=[[image.image]], return_row_col_info=True, return_tensors="np")
        text = self.processor.replace_image_token(inputs, 0)
        arrays = {"pixel_values": np.ascontiguousarray(inputs["pixel_values"][0], dtype=np.float32)}
        if "pixel_attention_mask" in inputs:
            arrays["pixel_attention_mask"] = np.ascontiguousarray(inputs["pixel_attention_mask"][0], dtype=bool)
        return self.tokenizer.encode(text, add_special_tokens=False), arrays


PROMPT_IMAGE_PROCESSORS: dict[str, type[PromptImageProcessor]] = {
    "idefics3": Idefics3PromptImages,
}
