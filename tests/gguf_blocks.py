"""Random GGUF blocks of every type the kernels run, for tests: random bytes, with each block's
float16 scales set to finite values of a realistic size (random bytes there would give NaNs and
infinities, which no quantizer writes), and MXFP4's E8M0 scale bytes to powers of two of a
realistic size."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# Byte offsets of each type's float16 fields within a block (scales, super-scales, minimums).
HALF_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "IQ4_NL": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,),
    "MXFP4": (),  # its scale is byte 0, an E8M0 exponent (see random_blocks)
}
BLOCK_TYPES = tuple(HALF_FIELDS)
# The size of a typical code times its sub-scale, per type: scales of 0.05 / this give weights of
# about 0.05 (what a trained model's are), so random models stay numerically sane.
TYPICAL_CODE = {
    "Q4_0": 4, "Q4_1": 8, "Q5_0": 8, "Q5_1": 16, "Q8_0": 64, "IQ4_NL": 60,
    "Q2_K": 12, "Q3_K": 32, "Q4_K": 256, "Q5_K": 512, "Q6_K": 1024, "IQ4_XS": 960, "MXFP4": 2,
}


def random_blocks(type_name: str, rows: int, columns: int, seed: int = 0, scale: float | None = None) -> np.ndarray:
    """[rows, bytes of a row] uint8: random blocks of `type_name` for a [rows, columns] weight;
    its float16 scales ~N(0, scale) (default: weights of about 0.05)."""
    if scale is None:
        scale = 0.05 / TYPICAL_CODE[type_name]
    qtype = GGMLQuantizationType[type_name]
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * columns // block_values, block_bytes), dtype=np.uint8)
    for offset in HALF_FIELDS[type_name]:
        halves = (rng.standard_normal(blocks.shape[0]) * scale).astype(np.float16)
        blocks[:, offset : offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    if type_name == "MXFP4":  # scales 2^(e - 127) (values doubled, scale halved): about `scale`, within 2x
        exponent = np.log2(scale) + 127 + rng.integers(-1, 2, size=blocks.shape[0])
        blocks[:, 0] = np.clip(np.round(exponent), 1, 254).astype(np.uint8)
    return blocks.reshape(rows, -1)
