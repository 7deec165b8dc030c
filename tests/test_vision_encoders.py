"""Vision encoders against transformers: the image embeddings a tiny random model's own class
computes from its own processor's pixels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from roseinfer.models.vision.idefics3 import Idefics3VisionEncoder

transformers = pytest.importorskip("transformers")


def tiny_idefics3():
    config = transformers.Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           patch_size=4, image_size=32),
        text_config=dict(model_type="llama", hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=300),
        scale_factor=2, image_token_id=299,
    )
    torch.manual_seed(0)
    return transformers.Idefics3ForConditionalGeneration(config).eval()


def test_idefics3_tiles_embed_as_transformers_does():
    model = tiny_idefics3()
    processor = transformers.Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    rng = np.random.default_rng(0)
    # one image split into a grid of tiles plus its global view, one small enough for one tile
    images = [Image.fromarray(rng.integers(0, 255, (50, 70, 3), dtype=np.uint8)),
              Image.fromarray(rng.integers(0, 255, (30, 20, 3), dtype=np.uint8))]
    inputs = processor(images=[images], return_tensors="pt")
    with torch.no_grad():
        expected = model.model.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"]).pooler_output[0]

    encoder = Idefics3VisionEncoder.from_hf_config(model.config.to_dict())
    state = {k.removeprefix("model."): v for k, v in model.state_dict().items()
             if k.startswith(("model.vision_model.", "model.connector."))}
    encoder.load_state_dict(state)
    tiles, masks = inputs["pixel_values"][0], inputs["pixel_attention_mask"][0]
    ours = encoder.encode(tiles, masks)
    assert ours.shape == expected.shape == (tiles.shape[0] * encoder.tokens_per_tile, 48)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    # a tile alone gives the same rows as within the batch (no tile sees another)
    torch.testing.assert_close(encoder.encode(tiles[-1:], masks[-1:]), expected[-encoder.tokens_per_tile:],
                               rtol=1e-5, atol=1e-5)
