"""GGUF files beyond the default model: tiny Llama-family models written the way llama.cpp's
converter writes them (permuted q/k rows, quantized matrices), loaded by roseinfer and by
transformers (the reference) from the same file; and clear errors for what cannot be loaded."""

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf_blocks import BLOCK_TYPES
from support import compare_logits_step_by_step, tiny_hf_model, write_llama_gguf

from roseinfer import InferenceEngine, ModelLoadError
from roseinfer.models.gguf_file import GGUFFile

TOLERANCE = 1e-3
PROMPTS = [[5, 9, 30, 31, 200], [7] * 19 + [40, 41], [300]]


@pytest.mark.parametrize(
    ("arch", "matrix_type"),
    [("llama", "F32"), ("llama", "Q8_0"), ("llama", "Q4_0"), ("qwen2", "Q4_1"), ("qwen2", "F16"),
     ("qwen3", "F32")],
)
def test_gguf_logits_match_transformers(arch, matrix_type, tmp_path):
    original = tiny_hf_model(arch, tmp_path / "hf")
    path = tmp_path / f"tiny-{arch}-{matrix_type}.gguf"
    write_llama_gguf(original, tmp_path / "hf", path, arch, matrix_type)
    if matrix_type == "F32":
        # The file is exact, so the original model is the reference. (transformers' own GGUF
        # loader ignores Qwen3's head_dim when it differs from hidden_size / heads.)
        reference = original
    else:
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, gguf_file=path.name, dtype=torch.float32
        ).eval()

    engine = InferenceEngine(str(path), num_kv_blocks=32, max_num_batched_tokens=16, quantization="none")
    assert engine.model_config.architecture == "llama"
    worst = compare_logits_step_by_step(engine, reference, PROMPTS, 4)
    assert worst < TOLERANCE, f"{arch}/{matrix_type}: max |logit difference| {worst}"


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_every_block_type_loads_runs_and_generates(type_name, tmp_path):
    """A tiny Llama whose every matrix (embedding and head included) is random blocks of one type:
    exact (--quantization none) its logits are transformers' on the same file (which expands it
    with gguf's numpy code); in its own blocks (the default, auto) within the rounding of the
    activations, and it generates."""
    original = tiny_hf_model("llama-256", tmp_path / "hf")
    path = tmp_path / f"tiny-{type_name}.gguf"
    write_llama_gguf(original, tmp_path / "hf", path, "llama", type_name, random_blocks=True)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    prompts = [[5, 9, 30, 31, 200], [7] * 12 + [40, 41]]
    exact = InferenceEngine(str(path), num_kv_blocks=32, quantization="none")
    assert compare_logits_step_by_step(exact, reference, prompts, 3) < TOLERANCE
    del exact
    engine = InferenceEngine(str(path), num_kv_blocks=32)
    assert engine.config.quantization == "auto"
    kinds = {type(m).__name__ for m in engine.model.modules()}
    assert "BlockLinear" in kinds and "Linear" not in kinds and "PanelLinear" not in kinds
    assert engine.model.model.embed_tokens.blocks.qtype.name == type_name
    worst = compare_logits_step_by_step(engine, reference, prompts, 3)
    # 8-bit activations (per 32 or 256 values) through 2 layers: measured 0.5-4.4% of the logits'
    # range over the types (the kernels' rounding itself is checked exactly in test_gguf_kernels.py).
    spread = reference(torch.tensor([prompts[1]])).logits.max() - reference(torch.tensor([prompts[1]])).logits.min()
    assert worst < 0.06 * spread.item(), f"{type_name}: max |logit difference| {worst} in its own blocks"
    assert len(engine.generate("Paged attention", max_new_tokens=8, stop_on_eos=False)) > 0


def _write_gguf(path, arch: str, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]]):
    writer = gguf.GGUFWriter(str(path), arch=arch)
    for name, (array, raw_dtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "mamba.gguf"
    _write_gguf(path, "mamba", {"token_embd.weight": (np.zeros((4, 32), np.float32), None)})
    with pytest.raises(ModelLoadError, match="architecture 'mamba' is not supported"):
        InferenceEngine(str(path))


def test_the_loaders_read_what_the_registered_classes_declare(tmp_path):
    """The Hugging Face model_types and GGUF architectures the loaders accept, and the architecture
    each maps to, are the registered model classes' own declarations, and each such class reads
    that file's config itself; an unknown model_type is refused with that list."""
    import json

    from roseinfer.models.hf_config import model_config_from_hf
    from roseinfer.models.registry import (
        GGUF_ARCHITECTURES,
        GGUF_EXPERT_ARCHITECTURES,
        HF_MODEL_TYPES,
        MODEL_CLASSES,
    )

    assert {"llama", "qwen3", "gemma3", "phi3", "qwen2moe", "gpt2"} <= set(GGUF_ARCHITECTURES)
    assert GGUF_EXPERT_ARCHITECTURES == {"llama": "moe"}  # Mixtral's GGUF files
    for names, attribute, reader in ((HF_MODEL_TYPES, "hf_model_types", "config_from_hf"),
                                     (GGUF_ARCHITECTURES, "gguf_architectures", "config_from_gguf"),
                                     (GGUF_EXPERT_ARCHITECTURES, "gguf_expert_architectures", "config_from_gguf")):
        for name, architecture in names.items():
            assert getattr(MODEL_CLASSES[architecture], attribute)[name] == architecture
            assert callable(getattr(MODEL_CLASSES[architecture], reader)), (name, reader)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(ModelLoadError, match=r"model_type 'mamba' is not supported; supported: \[.*'gemma3_text'.*'qwen3_moe'"):
        model_config_from_hf(tmp_path)


def test_unsupported_tensor_type_is_named(tmp_path):
    path = tmp_path / "ternary.gguf"
    weights = np.random.default_rng(0).standard_normal((2, 256), dtype=np.float32)
    qtype = gguf.GGMLQuantizationType.TQ2_0
    _write_gguf(path, "llama", {"blk.0.attn_q.weight": (gguf.quants.quantize(weights, qtype), qtype)})
    with pytest.raises(ModelLoadError, match="blk.0.attn_q.weight.*TQ2_0.*cannot run.*supported: .*Q4_K"):
        GGUFFile(path).load_tensor("blk.0.attn_q.weight")


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16"])
def test_dequantized_tensors_keep_their_shape_and_values(type_name, tmp_path):
    """Each supported type comes back in PyTorch's [rows, columns] order, within its precision."""
    weights = np.random.default_rng(1).standard_normal((3, 64), dtype=np.float32)
    qtype = gguf.GGMLQuantizationType[type_name]
    path = tmp_path / f"{type_name}.gguf"
    _write_gguf(path, "llama", {"w.weight": (gguf.quants.quantize(weights, qtype), qtype)})
    loaded = GGUFFile(path).load_tensor("w.weight")
    assert loaded.shape == (3, 64) and loaded.dtype == torch.float32
    error = (loaded.numpy() - weights).std() / weights.std()
    assert error < 0.12, f"{type_name}: relative error {error:.3f}"
