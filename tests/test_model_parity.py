"""Logits of prefill (also in chunks) and of decode steps equal transformers' (fp32, < 1e-3), for
tiny random Llama, Qwen2, Qwen3 and GPT-2 models saved as Hugging Face directories, for the seed's
GPT checkpoint format, and for the default SmolLM2 GGUF model."""

import pytest
import torch
from support import compare_logits_step_by_step, tiny_hf_model

from roseinfer import InferenceEngine

TOLERANCE = 1e-3


def prompts_for(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    lengths = [1, 7, 33, 70]
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gpt2"])
def test_tiny_model_logits_match_transformers(kind, tmp_path):
    reference = tiny_hf_model(kind, tmp_path / kind)
    # A small token budget forces chunked prefill mixed with decodes.
    engine = InferenceEngine(str(tmp_path / kind), num_kv_blocks=64, max_num_batched_tokens=40)
    worst = compare_logits_step_by_step(engine, reference, prompts_for(reference.config.vocab_size), 6)
    assert worst < TOLERANCE, f"{kind}: max |logit difference| {worst}"
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_seed_checkpoint_logits_match_transformers(tmp_path):
    """The seed's GPT (exact GELU) saved as {"model": state_dict, "config": {...}} in its own names."""
    reference = tiny_hf_model("gpt2-exact-gelu", tmp_path / "hf")
    hf_state = reference.state_dict()
    conv1d = {"attn.c_attn": "attn.qkv_proj", "attn.c_proj": "attn.out_proj",
              "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
    seed_state = {
        "token_embedding.weight": hf_state["transformer.wte.weight"],
        "position_embedding.weight": hf_state["transformer.wpe.weight"],
        "ln_f.weight": hf_state["transformer.ln_f.weight"],
        "ln_f.bias": hf_state["transformer.ln_f.bias"],
        "lm_head.weight": hf_state["transformer.wte.weight"],
    }
    for layer in range(reference.config.n_layer):
        prefix = f"transformer.h.{layer}."
        for hf_name, seed_name in (("ln_1", "ln1"), ("ln_2", "ln2")):
            for p in ("weight", "bias"):
                seed_state[f"blocks.{layer}.{seed_name}.{p}"] = hf_state[f"{prefix}{hf_name}.{p}"]
        for hf_name, seed_name in conv1d.items():
            seed_state[f"blocks.{layer}.{seed_name}.weight"] = hf_state[f"{prefix}{hf_name}.weight"].t()
            seed_state[f"blocks.{layer}.{seed_name}.bias"] = hf_state[f"{prefix}{hf_name}.bias"]
    config = dict(vocab_size=reference.config.vocab_size, d_model=64, n_heads=4, n_layers=3, d_ff=256,
                  max_position_embeddings=512, dropout=0.0)
    checkpoint = tmp_path / "seed.pt"
    torch.save({"model": seed_state, "config": config}, checkpoint)

    engine = InferenceEngine(checkpoint_path=str(checkpoint), tokenizer_name=str(tmp_path / "hf"), num_kv_blocks=64)
    worst = compare_logits_step_by_step(engine, reference, prompts_for(config["vocab_size"]), 4)
    assert worst < TOLERANCE


def test_default_model_logits_match_transformers(default_engine, hf_default_model, chat_prompt_ids):
    worst = compare_logits_step_by_step(default_engine, hf_default_model, chat_prompt_ids[:3], 4)
    assert worst < TOLERANCE


def test_gguf_embedding_tables_keep_their_blocks(tmp_path):
    """The default model's Q8_0 embedding is kept as its blocks in every mode: its rows come back
    exactly as gguf's own code expands them (the token-exact tests run through it), and in float32
    the tied LM head reads the same blocks (no copy). A Hugging Face float table stays as it is."""
    from gguf import dequantize

    from roseinfer import LLM
    from roseinfer.layers.linear import BlockLinear
    from roseinfer.models.default_model import default_model_path
    from roseinfer.models.gguf_file import GGUFFile

    model = LLM(kv_cache_memory=0.05, quantization="none").engine.runner.model
    llm_embedding = model.model.embed_tokens
    assert llm_embedding.blocks is not None and llm_embedding.weight.numel() == 0
    assert isinstance(model.lm_head, BlockLinear) and model.lm_head.exact  # none: exact products
    assert model.lm_head.parts[0].packed.data_ptr() == llm_embedding.blocks.packed.data_ptr()
    gguf = GGUFFile(default_model_path())
    raw = gguf.tensor("token_embd.weight")
    table = torch.from_numpy(dequantize(raw.data.numpy(), raw.qtype).copy()).float()  # gguf's own reading
    ids = torch.tensor([0, 1, 17, 9000, table.shape[0] - 1])
    assert torch.equal(llm_embedding(ids), table[ids])

    tiny_hf_model("llama", tmp_path / "hf")
    hf_model = LLM(str(tmp_path / "hf"), kv_cache_memory=0.05).engine.runner.model
    assert hf_model.model.embed_tokens.blocks is None and hf_model.model.embed_tokens.weight.numel() > 0
