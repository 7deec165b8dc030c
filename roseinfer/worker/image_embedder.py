"""A vision-language model's image rows for a step: the encoder run once per image (its output
kept, keyed by the image's digest, while prompts that hold it are being computed: a chunked
prefill may take an image's placeholders over several steps, and a conversation resent with the
same image encodes it once), then the rows of the placeholders this step computes."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from roseinfer.common.messages import ImageInput


@dataclass
class StepImageRows:
    """Where in a step's flattened batch image rows go, and the rows."""

    batch_rows: torch.Tensor  # [n] int64
    embeddings: torch.Tensor  # [n, hidden]


class ImageEmbedder:
    def __init__(self, encoder: nn.Module, device: torch.device, dtype: torch.dtype, capacity: int = 16) -> None:
        self.encoder = encoder.to(device=device, dtype=dtype).eval()
        self.device, self.dtype = device, dtype
        self.capacity = capacity  # images whose rows are kept (least recently used dropped first)
        self._rows: OrderedDict[str, torch.Tensor] = OrderedDict()

    def _encoded(self, image: ImageInput) -> torch.Tensor:
        rows = self._rows.get(image.digest)
        if rows is None:
            pixels = torch.from_numpy(image.pixel_values).to(self.device, self.dtype)
            mask = None if image.pixel_attention_mask is None else torch.from_numpy(image.pixel_attention_mask)
            rows = self.encoder.encode(pixels, mask)
            self._rows[image.digest] = rows
            while len(self._rows) > self.capacity:
                self._rows.popitem(last=False)
        else:
            self._rows.move_to_end(image.digest)
        return rows

    def chunk_rows(self, images: list[ImageInput], token_ids: list[int], start: int, end: int,
                   first_batch_row: int) -> list[tuple[np.ndarray, torch.Tensor]]:
        """For a request computing positions [start, end) at batch rows from `first_batch_row`:
        (batch rows, embeddings) of each image placeholder among them."""
        found = []
        for image in images:
            if image.offset >= end or image.offset + image.length <= start:
                continue
            run = np.asarray(token_ids[image.offset : image.offset + image.length])
            positions = image.offset + np.flatnonzero(run == image.embed_token_id)
            encoded = self._encoded(image)
            if len(positions) != encoded.shape[0]:
                raise RuntimeError(f"an image has {len(positions)} placeholders but its encoder gave "
                                   f"{encoded.shape[0]} rows")
            wanted = (positions >= start) & (positions < end)
            if wanted.any():
                found.append((positions[wanted] - start + first_batch_row, encoded[torch.from_numpy(wanted)]))
        return found

    @staticmethod
    def gather(parts: list[tuple[np.ndarray, torch.Tensor]], device: torch.device) -> StepImageRows | None:
        if not parts:
            return None
        return StepImageRows(torch.from_numpy(np.concatenate([rows for rows, _ in parts])).to(device),
                             torch.cat([embeddings for _, embeddings in parts]))
