"""Gemma 4 (text, models/gemma4.py) against transformers (float32, eager attention).

Tiny random models built by transformers' own Gemma4 classes, dense and mixture of experts, each
with what sets the family apart: sliding layers (16-wide heads, 2 KV heads) and full ones
(32-wide, 1 KV head, values = keys), the proportional rope, the last two layers reading earlier
layers' keys and values (double-wide MLPs), per-layer embeddings, per-layer output scalars and
soft-capped logits; saved as Hugging Face directories and converted to GGUF by llama.cpp's own
converter (tests/hf_to_gguf.py). Prompts past the window (12), prefilled in chunks; logits with
teacher forcing and greedy tokens equal transformers'.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
import transformers
from hf_to_gguf import convert_hf_to_gguf, llama_cpp_chat_template
from support import CORPUS, assert_chat_renders_as_transformers, compare_logits_step_by_step

from roseinfer import LLM
from roseinfer.sampling_params import SamplingParams

TOLERANCE = 1e-3
WINDOW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention",
               "sliding_attention", "sliding_attention", "full_attention"]
TURN_TOKENS = ["<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>"]


def _tokenizer(path: Path) -> int:
    """A Gemma-style tokenizer.json (sentencepiece BPE with byte fallback, which the converter's
    Gemma 4 vocabulary reader asks for), trained on the test corpus; returns its size."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20), model_writer=model, vocab_size=400, model_type="bpe",
        byte_fallback=True, add_dummy_prefix=False, remove_extra_whitespaces=False,
        normalization_rule_name="identity", pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>",
        eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>", minloglevel=2, user_defined_symbols=TURN_TOKENS,
    )
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.model").write_bytes(model.getvalue())
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "add_bos_token": True, "tokenizer_class": "GemmaTokenizer",
    }))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    (path / "tokenizer.model").unlink()
    tokenizer.save_pretrained(path)  # tokenizer.json
    return len(tokenizer)


def _config(vocab: int, moe: bool) -> transformers.Gemma4TextConfig:
    config = transformers.Gemma4TextConfig(
        vocab_size=vocab, vocab_size_per_layer_input=vocab, hidden_size=64, intermediate_size=96,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, layer_types=list(LAYER_TYPES),
        max_position_embeddings=512, sliding_window=WINDOW, num_kv_shared_layers=2, use_double_wide_mlp=True,
        hidden_size_per_layer_input=8, final_logit_softcapping=30.0, eos_token_id=1, bos_token_id=2,
        pad_token_id=0, enable_moe_block=moe, num_experts=4 if moe else None, top_k_experts=2 if moe else None,
        moe_intermediate_size=24 if moe else None,
    )
    config.initializer_range = 0.1
    return config


def _randomize(model: torch.nn.Module) -> None:
    """What transformers initialises to ones (norm weights, layer scalars, router scales) drawn
    around one, so that a weight loaded in the wrong place shows."""
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("norm.weight", "layer_scalar", "router.scale", "per_expert_scale")):
                tensor.copy_(1.0 + 0.3 * torch.randn_like(tensor))


def _build(kind: str, path: Path) -> None:
    vocab = _tokenizer(path)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(vocab, kind == "moe"), dtype=torch.float32)
    _randomize(model)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma4")
    paths = {}
    for kind in ("dense", "moe"):
        _build(kind, root / kind)
        paths[kind] = root / kind
        paths[f"{kind}.gguf"] = convert_hf_to_gguf(root / kind, root / f"{kind}.gguf")
    return paths


def _reference(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (5, 11, 40)]


@torch.no_grad()
def _greedy_reference(reference, prompts: list[list[int]]) -> list[list[int]]:
    reference.generation_config.eos_token_id = None
    outputs = []
    for prompt in prompts:
        ids = reference.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                                 pad_token_id=0)
        outputs.append(ids[0, len(prompt):].tolist())
    return outputs


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


@pytest.mark.parametrize(("kind", "source"), [("dense", "hf"), ("dense", "gguf"), ("moe", "hf"), ("moe", "gguf")])
def test_logits_and_greedy_tokens_match_transformers(models, kind, source):
    """Prefill in chunks of 16 past the window, decode steps with teacher forcing: every sampled
    row's logits within float32 tolerance of transformers'; then greedy tokens equal."""
    reference = _reference(models[kind])
    prompts = _prompts(reference.config.vocab_size)
    model = str(models[f"{kind}.gguf"] if source == "gguf" else models[kind])
    llm = LLM(model, num_kv_blocks=64, max_num_batched_tokens=16, quantization="none",
              tokenizer=str(models[kind]))
    config = llm.llm_engine.model_config
    assert (config.architecture, config.sliding_window) == ("gemma4", WINDOW)
    assert llm.llm_engine.model_runner.fused_decoder is None  # op by op: no fused step describes Gemma 4
    worst = compare_logits_step_by_step(llm.engine, reference, prompts, 2)
    assert worst < TOLERANCE, f"{kind} ({source}): max |logit difference| {worst}"
    assert _greedy(llm, prompts) == _greedy_reference(reference, prompts), f"{kind} ({source})"
    engine = llm.llm_engine
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_shared_layers_read_their_source_pool_and_own_none(models):
    """Layers 4 and 5 read the keys and values of layers 3 (sliding) and 2 (full): they hold the
    same pool tensor, the full layers' pools hold 1 KV head of 32, the sliding ones 2 of 16, and
    the planner counts only the four pools that exist."""
    from roseinfer.models.hf_config import model_config_from_hf

    llm = LLM(str(models["dense"]), num_kv_blocks=32, quantization="none")
    config = llm.llm_engine.model_config
    assert config.kv_shared_layers == {4: 3, 5: 2}
    assert config.layer_kv_dims == {2: (1, 32), 5: (1, 32)} and (config.num_kv_heads, config.head_dim) == (2, 16)
    caches = llm.llm_engine.model_runner.kv_caches
    assert caches[4] is caches[3] and caches[5] is caches[2]
    assert [tuple(cache.shape[-2:]) for cache in caches] == [(2, 16), (2, 16), (1, 32), (2, 16), (2, 16), (1, 32)]
    assert len({id(cache) for cache in caches}) == 4
    hf = model_config_from_hf(models["dense"])
    # Per block of 4 tokens in float32: keys and values of 2 x 16 (three sliding pools), 1 x 32 (one full).
    assert hf.kv_block_bytes(4, torch.float32, layers=[0, 1, 3, 4]) == 3 * 2 * 4 * 32 * 4
    assert hf.kv_block_bytes(4, torch.float32, layers=[2, 5]) == 2 * 4 * 32 * 4


def test_config_from_both_files(models):
    from roseinfer.models.gguf_file import GGUFFile
    from roseinfer.models.gguf_loader import model_config_from_gguf
    from roseinfer.models.hf_config import model_config_from_hf

    for kind in ("dense", "moe"):
        hf, gguf = model_config_from_hf(models[kind]), model_config_from_gguf(GGUFFile(models[f"{kind}.gguf"]))
        for field in ("architecture", "layer_types", "sliding_window", "final_logit_softcapping", "num_layers",
                      "head_dim", "num_kv_heads", "layer_kv_dims", "kv_shared_layers", "moe", "vocab_size"):
            assert getattr(hf, field) == getattr(gguf, field), f"{kind}: {field}"
        assert hf.family_options["mlp_widths"] == gguf.family_options["mlp_widths"] == [96] * 4 + [192] * 2
        for key in ("k_eq_v", "per_layer_input_size", "per_layer_vocab_size"):
            assert hf.family_options[key] == gguf.family_options[key], f"{kind}: {key}"
        for kind_of_layer, rope in hf.family_options["rope"].items():
            assert rope["theta"] == gguf.family_options["rope"][kind_of_layer]["theta"]
            assert rope["fraction"] == gguf.family_options["rope"][kind_of_layer]["fraction"]


def test_chat_template_and_thinking_render_as_transformers(models):
    """Gemma 4's own template (llama.cpp's copy of google/gemma-4-31B-it's): system turn, several
    turns, an answer that kept its thinking (stripped on render), tools, and thinking on and off."""
    from roseinfer.tokenizer import Tokenizer

    template = llama_cpp_chat_template("google-gemma-4-31B-it")
    reference = transformers.AutoTokenizer.from_pretrained(models["dense"])
    ours = Tokenizer.from_pretrained_dir(models["dense"])
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City"}},
                           "required": ["city"]}}}
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    chat = [{"role": "user", "content": "Hi! Café?"},
            {"role": "assistant", "content": "<|channel>thought\nhmm<channel|>Hello."},
            {"role": "user", "content": "A joke."}]
    conversations = [
        (chat, {}),
        (chat, {"enable_thinking": True}),
        (chat, {"enable_thinking": False}),
        ([{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}], {"enable_thinking": True}),
        ([{"role": "user", "content": "Weather in Paris?"}, call,
          {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], {"tools": [tool]}),
    ]
    assert assert_chat_renders_as_transformers(ours, reference, template, conversations) == 10
    ours = Tokenizer(ours.backend, chat_template=template, bos_token=ours.bos_token, eos_token=ours.eos_token)
    thinking = ours.apply_chat_template(chat, enable_thinking=True)
    assert thinking.startswith("<bos><|turn>system\n<|think|>") and thinking.endswith("<|turn>model\n")
    plain = ours.apply_chat_template(chat)
    assert plain.endswith("<|turn>model\n<|channel>thought\n<channel|>") and "hmm" not in plain
