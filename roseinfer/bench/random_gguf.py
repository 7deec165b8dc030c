"""Random-weight models of real shapes as F16 GGUF files, for benchmarks at user sizes.

No model hub is reachable here, so the 1B-8B models that users bring are stood in for by random
weights of the same shapes, with the default model's tokenizer, written as F16 and then quantized
by llama.cpp's own `llama-quantize` (Q4_K_M, Q8_0, Q4_0, ...). Speed depends on the shapes and the
types, not on the values. Tensors are written one at a time, so an 8B file (16 GB) never sits in
memory.

    python -m roseinfer.bench.random_gguf --shape 1b --output llama-1b-f16.gguf

Shapes: Llama (1b, 8b), a mixture of experts of OLMoE-1B-7B's shape (olmoe-1b-7b: 64 experts,
8 a token, expert FFN 1024) and Gemma 3 4B's (gemma3-4b: local/global layers, q/k norms, the
norms around each block). The tensor names and metadata keys are those llama.cpp's converter
writes for the architecture, so llama.cpp loads the same file.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, RopeScalingType

from roseinfer.models.default_model import default_model_path


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int  # the dense FFN's width, or each expert's
    tied: bool = False
    arch: str = "llama"  # llama | olmoe | gemma3
    head_dim: int | None = None  # hidden // heads where None
    experts: int = 0
    experts_used: int = 0
    sliding_window: int | None = None


SHAPES = {
    # Llama-3.2-1B's body (the vocabulary is the default model's, 49,152 tokens).
    "1b": ModelShape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192),
    # Llama-3.1-8B's body.
    "8b": ModelShape(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336),
    # OLMoE-1B-7B's body: 6.9B parameters, 1.3B of them active for a token.
    "olmoe-1b-7b": ModelShape(hidden=2048, layers=16, heads=16, kv_heads=16, ffn=1024, arch="olmoe",
                              experts=64, experts_used=8),
    # Gemma-3-4B's body (text): five local layers (window 1024) to one global, tied embeddings.
    "gemma3-4b": ModelShape(hidden=2560, layers=34, heads=8, kv_heads=4, ffn=10240, arch="gemma3", head_dim=256,
                            tied=True, sliding_window=1024),
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


def _metadata(writer: GGUFWriter, shape: ModelShape, vocab: int, head_dim: int) -> None:
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_vocab_size(vocab)
    writer.add_file_type(1)  # mostly F16
    if shape.arch == "gemma3":
        writer.add_layer_norm_rms_eps(1e-6)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_freq_base(1_000_000.0)
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(8.0)
        writer.add_sliding_window(shape.sliding_window)
        return
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0 if shape.arch == "olmoe" else 500000.0)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)


def _layer_tensors(shape: ModelShape, i: int, head_dim: int) -> list[tuple[str, tuple[int, ...]]]:
    """One layer's tensors as (name, numpy shape: rows first), as llama.cpp names them."""
    q_rows, kv_rows = shape.heads * head_dim, shape.kv_heads * head_dim
    tensors = [
        (f"blk.{i}.attn_norm.weight", (shape.hidden,)),
        (f"blk.{i}.attn_q.weight", (q_rows, shape.hidden)),
        (f"blk.{i}.attn_k.weight", (kv_rows, shape.hidden)),
        (f"blk.{i}.attn_v.weight", (kv_rows, shape.hidden)),
        (f"blk.{i}.attn_output.weight", (shape.hidden, q_rows)),
        (f"blk.{i}.ffn_norm.weight", (shape.hidden,)),
    ]
    if shape.arch == "olmoe":  # q/k norms over the whole projection
        tensors += [(f"blk.{i}.attn_q_norm.weight", (q_rows,)), (f"blk.{i}.attn_k_norm.weight", (kv_rows,))]
    if shape.arch == "gemma3":  # per-head q/k norms, norms after attention and FFN
        tensors += [(f"blk.{i}.attn_q_norm.weight", (head_dim,)), (f"blk.{i}.attn_k_norm.weight", (head_dim,)),
                    (f"blk.{i}.post_attention_norm.weight", (shape.hidden,)),
                    (f"blk.{i}.post_ffw_norm.weight", (shape.hidden,))]
    if shape.experts:
        tensors += [
            (f"blk.{i}.ffn_gate_inp.weight", (shape.experts, shape.hidden)),
            (f"blk.{i}.ffn_gate_exps.weight", (shape.experts, shape.ffn, shape.hidden)),
            (f"blk.{i}.ffn_up_exps.weight", (shape.experts, shape.ffn, shape.hidden)),
            (f"blk.{i}.ffn_down_exps.weight", (shape.experts, shape.hidden, shape.ffn)),
        ]
    else:
        tensors += [
            (f"blk.{i}.ffn_gate.weight", (shape.ffn, shape.hidden)),
            (f"blk.{i}.ffn_up.weight", (shape.ffn, shape.hidden)),
            (f"blk.{i}.ffn_down.weight", (shape.hidden, shape.ffn)),
        ]
    return tensors


def write_random_model(shape: ModelShape, output: Path, seed: int = 0, name: str = "random-model") -> None:
    source = GGUFReader(str(default_model_path()))
    writer = GGUFWriter(str(output), arch=shape.arch)
    vocab = _copy_tokenizer(writer, source)
    head_dim = shape.head_dim or shape.hidden // shape.heads
    writer.add_name(name)
    _metadata(writer, shape, vocab, head_dim)

    tensors: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, shape.hidden))]
    for i in range(shape.layers):
        tensors += _layer_tensors(shape, i, head_dim)
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
            data = (rng.standard_normal(dims, dtype=np.float32) / np.sqrt(dims[-1])).astype(np.float16)
        writer.write_tensor_data(data)
        del data
    writer.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_random_model(SHAPES[args.shape], args.output, args.seed, name=f"random-{args.shape}")
    print(f"wrote {args.output} ({args.output.stat().st_size / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
