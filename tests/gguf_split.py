"""Splitting a GGUF file into shards the way llama.cpp's `gguf-split --split` writes them: the
first shard carries every metadata key (or, with --no-tensor-in-metadata, only them), each shard
`split.no` (from 0), `split.count` and `split.tensors.count`, and its own tensors with offsets into
its own data section; shards are named PREFIX-00001-of-000NN.gguf. gguf's own GGUFWriter writes
that layout when given a tensor limit (the same writer llama.cpp's converter splits with)."""

from __future__ import annotations

from pathlib import Path

import gguf


def split_gguf(source: Path, output: Path, max_tensors: int, metadata_only_first: bool = False) -> list[Path]:
    """Write `source` as shards named after `output` (its stem is the prefix); returns their paths."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(output, arch=arch, split_max_tensors=max_tensors,
                             small_first_shard=metadata_only_first)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the header's own counts, and the key the writer adds itself
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub_type)
    for tensor in reader.tensors:
        # The stored bytes as they are (a block type's rows of bytes: the writer infers its shape).
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    paths = writer.format_shard_names(Path(output))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return paths
