"""`roseinfer export-hf`: write a GGUF model of the Llama family as a Hugging Face directory
(config.json, model.safetensors in float32, tokenizer.json, tokenizer_config.json with the chat
template), so tools that only read Hugging Face checkpoints (transformers, vLLM) can serve the
same weights and tokenizer as roseinfer."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from roseinfer.config import ModelConfig
from roseinfer.errors import ModelLoadError
from roseinfer.models.default_model import default_model_path
from roseinfer.models.gguf_file import GGUFFile
from roseinfer.models.gguf_loader import gguf_weights, model_config_from_gguf
from roseinfer.tokenizer import Tokenizer

_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def hf_config(config: ModelConfig, model_type: str, tokenizer: Tokenizer) -> dict:
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling and config.rope_scaling.get("rope_type") == "linear":
        rope = {"rope_type": "linear", "factor": config.rope_scaling["factor"], "rope_theta": config.rope_theta}
    elif config.rope_scaling:
        raise ModelLoadError(f"exporting rope scaling {config.rope_scaling.get('rope_type')!r} is not supported")
    return {
        "architectures": [_MODEL_TYPES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": rope,
        "rope_scaling": None if rope["rope_type"] == "default" else rope,
        "attention_bias": config.attention_bias,
        "hidden_act": config.hidden_act,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": config.eos_token_ids[0] if len(config.eos_token_ids) == 1 else config.eos_token_ids,
        "torch_dtype": "float32",
    }


def export_gguf_to_hf(gguf_path: Path | None, output: Path) -> Path:
    gguf = GGUFFile(gguf_path or default_model_path())
    if gguf.architecture not in _MODEL_TYPES:
        raise ModelLoadError(f"export-hf handles the Llama family ({', '.join(_MODEL_TYPES)}), not {gguf.architecture!r}")
    config = model_config_from_gguf(gguf)
    tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    output.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.contiguous() for name, tensor in gguf_weights(gguf, config, expand=True)}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(output / "model.safetensors"), metadata={"format": "pt"})
    (output / "config.json").write_text(json.dumps(hf_config(config, gguf.architecture, tokenizer), indent=2))
    (output / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": config.eos_token_ids}, indent=2
    ))
    write_hf_tokenizer(tokenizer, config.max_position_embeddings, output)
    return output


def write_hf_tokenizer(tokenizer: Tokenizer, max_length: int, output: Path) -> None:
    """tokenizer.json and tokenizer_config.json (with the chat template) into `output`."""
    tokenizer.backend.save(str(output / "tokenizer.json"))
    (output / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "add_bos_token": tokenizer.add_bos_token,
        "chat_template": tokenizer.chat_template,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }, indent=2))
