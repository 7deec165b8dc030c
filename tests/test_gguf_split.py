"""A GGUF file split in shards (llama.cpp's gguf-split layout) loads as one model: the same
greedy tokens as the unsplit file, each shard memory-mapped where it lies; a missing or foreign
shard is a clear error."""

from pathlib import Path

import pytest
import torch
from gguf_split import split_gguf
from support import tiny_hf_model, write_llama_gguf

from roseinfer import ModelLoadError
from roseinfer.engine.llm import LLM
from roseinfer.models.gguf_file import GGUFFile
from roseinfer.sampling_params import SamplingParams

PROMPTS = [[5, 9, 30, 31, 200], [7] * 11 + [40, 41]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("split")
    model = tiny_hf_model("llama", root / "hf")
    path = root / "tiny-Q8_0.gguf"
    write_llama_gguf(model, root / "hf", path, "llama", "Q8_0")
    return path


def _tokens(model: str) -> list[list[int]]:
    llm = LLM(model, num_kv_blocks=32)
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("metadata_only_first", [False, True])
def test_split_file_generates_the_unsplit_tokens(tiny_file, tmp_path, metadata_only_first):
    shards = split_gguf(tiny_file, tmp_path / "tiny.gguf", max_tensors=4, metadata_only_first=metadata_only_first)
    assert len(shards) >= 3 and shards[0].name == f"tiny-00001-of-{len(shards):05d}.gguf"
    whole, split = GGUFFile(tiny_file), GGUFFile(shards[1])  # any shard names the whole file
    assert split.path == shards[0] and split.shard_paths == shards
    assert split.metadata == whole.metadata and split.tensor_names() == whole.tensor_names()
    for name in whole.tensor_names():
        ours, theirs = split.tensor(name), whole.tensor(name)
        ours, theirs = getattr(ours, "data", ours), getattr(theirs, "data", theirs)  # a block tensor's bytes
        assert torch.equal(ours, theirs)
        # Each tensor is a view into its own shard's memory map: nothing was copied to join them.
        maps = split._maps.values()
        assert any(m.ctypes.data <= ours.data_ptr() < m.ctypes.data + m.nbytes for m in maps), name
    assert len(split._maps) == len(shards) - metadata_only_first
    expected = _tokens(str(tiny_file))
    assert _tokens(str(shards[0])) == expected
    assert _tokens(str(tmp_path)) == expected  # a directory holding the shards: one model


def test_missing_or_mismatched_shard_is_named(tiny_file, tmp_path):
    shards = split_gguf(tiny_file, tmp_path / "tiny.gguf", max_tensors=6)
    shards[-1].unlink()
    with pytest.raises(ModelLoadError, match=shards[-1].name):
        GGUFFile(shards[0])
    renamed = tmp_path / "other-00001-of-00002.gguf"
    shards[0].rename(renamed)
    (tmp_path / "other-00002-of-00002.gguf").write_bytes(shards[1].read_bytes())
    with pytest.raises(ModelLoadError, match="do not match"):
        GGUFFile(renamed)
