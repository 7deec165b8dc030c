"""Model references (user/repo[@revision][:QUANT]) and which files of a repository they load:
parsed in one place, with no network (the Hub client is not called here)."""

import pytest

from roseinfer import ModelLoadError
from roseinfer.models.model_store import ModelRef, parse_model_ref, select_files

GGUF_REPO = [
    "README.md", "model-Q4_K_M.gguf", "model-Q8_0.gguf", "mmproj-model-f16.gguf",
    "BF16/model-BF16-00001-of-00002.gguf", "BF16/model-BF16-00002-of-00002.gguf",
]


def test_references_parse_and_paths_stay_local(tmp_path):
    assert parse_model_ref("user/repo") == ModelRef("user/repo")
    assert parse_model_ref("user/repo:q8_0") == ModelRef("user/repo", None, "q8_0")
    assert parse_model_ref("hf.co/user/repo@v1.0:Q4_K_M") == ModelRef("user/repo", "v1.0", "Q4_K_M")
    for local in ("/abs/model.gguf", "./model.gguf", "~/m", "model.gguf", "a/../b", "a/b/c"):
        assert parse_model_ref(local) is None, local


def test_a_gguf_repo_gives_the_quant_its_shards_and_mmproj():
    default = select_files(ModelRef("u/r"), GGUF_REPO)
    assert default.model_file == "model-Q4_K_M.gguf" and default.mmproj == "mmproj-model-f16.gguf"
    assert default.files == ["model-Q4_K_M.gguf", "mmproj-model-f16.gguf"]
    assert default.quants == ["BF16", "Q4_K_M", "Q8_0"]
    split = select_files(ModelRef("u/r", quant="bf16"), GGUF_REPO)
    assert split.files[:2] == ["BF16/model-BF16-00001-of-00002.gguf", "BF16/model-BF16-00002-of-00002.gguf"]
    with pytest.raises(ModelLoadError, match=r"u/r has no Q5_K_M GGUF file; its quants: BF16, Q4_K_M, Q8_0"):
        select_files(ModelRef("u/r", quant="Q5_K_M"), GGUF_REPO)
    with pytest.raises(ModelLoadError, match="lacks its shard"):
        select_files(ModelRef("u/r", quant="BF16"), GGUF_REPO[:-1])


def test_a_transformers_repo_gives_safetensors_and_tokenizer_never_pickles():
    names = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "pytorch_model.bin",
             "README.md"]
    assert select_files(ModelRef("u/r"), names).files == ["config.json", "model.safetensors", "tokenizer.json",
                                                         "tokenizer_config.json"]
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        select_files(ModelRef("u/r"), ["config.json", "pytorch_model.bin"])
