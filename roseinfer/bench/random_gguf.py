"""Random-weight Llama models of real shapes as F16 GGUF files, for benchmarks at user sizes.

No model hub is reachable here, so the 1B-8B models that users bring are stood in for by random
weights of the same shapes, with the default model's tokenizer, written as F16 and then quantized
by llama.cpp's own `llama-quantize` (Q4_K_M, Q8_0, Q4_0, ...). Speed depends on the shapes and the
types, not on the values. Tensors are written one at a time, so an 8B file (16 GB) never sits in
memory.

    python -m roseinfer.bench.random_gguf --shape 1b --output llama-1b-f16.gguf
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from roseinfer.models.default_model import default_model_path


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tied: bool = False


SHAPES = {
    # Llama-3.2-1B's body (the vocabulary is the default model's, 49,152 tokens).
    "1b": LlamaShape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192),
    # Llama-3.1-8B's body.
    "8b": LlamaShape(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336),
}


def _copy_tokenizer(writer: GGUFWriter, source: GGUFReader) -> int:
    """The default model's tokenizer keys; returns its vocabulary size."""
    vocab = 0
    for key, field in source.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            writer.add_key_value(key, value, vtype, sub_type=field.types[-1])
            if key == "tokenizer.ggml.tokens":
                vocab = len(value)
        else:
            writer.add_key_value(key, value, vtype)
    return vocab


def write_random_llama(shape: LlamaShape, output: Path, seed: int = 0, name: str = "random-llama") -> None:
    source = GGUFReader(str(default_model_path()))
    writer = GGUFWriter(str(output), arch="llama")
    vocab = _copy_tokenizer(writer, source)
    head_dim = shape.hidden // shape.heads
    writer.add_name(name)
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab)
    writer.add_file_type(1)  # mostly F16

    tensors: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, shape.hidden))]
    for i in range(shape.layers):
        tensors += [
            (f"blk.{i}.attn_norm.weight", (shape.hidden,)),
            (f"blk.{i}.attn_q.weight", (shape.heads * head_dim, shape.hidden)),
            (f"blk.{i}.attn_k.weight", (shape.kv_heads * head_dim, shape.hidden)),
            (f"blk.{i}.attn_v.weight", (shape.kv_heads * head_dim, shape.hidden)),
            (f"blk.{i}.attn_output.weight", (shape.hidden, shape.heads * head_dim)),
            (f"blk.{i}.ffn_norm.weight", (shape.hidden,)),
            (f"blk.{i}.ffn_gate.weight", (shape.ffn, shape.hidden)),
            (f"blk.{i}.ffn_up.weight", (shape.ffn, shape.hidden)),
            (f"blk.{i}.ffn_down.weight", (shape.hidden, shape.ffn)),
        ]
    tensors.append(("output_norm.weight", (shape.hidden,)))
    if not shape.tied:
        tensors.append(("output.weight", (vocab, shape.hidden)))

    def dtype_of(dims: tuple[int, ...]) -> type:
        return np.float32 if len(dims) == 1 else np.float16  # norms stay F32, as converters write them

    for tensor_name, dims in tensors:
        dtype = dtype_of(dims)
        raw_dtype = GGMLQuantizationType.F32 if dtype is np.float32 else GGMLQuantizationType.F16
        writer.add_tensor_info(tensor_name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize,
                               raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, dims in tensors:
        if len(dims) == 1:
            data = (1.0 + 0.1 * rng.standard_normal(dims, dtype=np.float32)).astype(np.float32)
        else:
            # Scaled like an initialised model (std 1/sqrt(fan-in)), so activations stay finite.
            data = (rng.standard_normal(dims, dtype=np.float32) / np.sqrt(dims[1])).astype(np.float16)
        writer.write_tensor_data(data)
        del data
    writer.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_random_llama(SHAPES[args.shape], args.output, args.seed, name=f"random-llama-{args.shape}")
    print(f"wrote {args.output} ({args.output.stat().st_size / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
