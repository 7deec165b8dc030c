"""Phi-3 / Phi-4-mini (fused q/k/v and gate/up, partial rotary, LongRoPE) and YaRN (Qwen3) against
transformers float32.

Tiny random models built by transformers' own classes, saved as Hugging Face directories and
converted to GGUF by llama.cpp's own converter; both files run with `quantization="none"`. The
LongRoPE model's original context is 32 tokens, so prompts past it (and generations that cross it)
are cheap; YaRN's too. transformers picks LongRoPE's factors per forward pass from the sequence's
length, which is what `layers/rotary.long_rope` reproduces per token.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hf_to_gguf import convert_hf_to_gguf, write_default_tokenizer
from support import EXACT, assert_chat_renders_as_transformers, compare_logits_step_by_step

from roseinfer import LLM, InferenceEngine, SamplingParams
from roseinfer.errors import ModelLoadError
from roseinfer.layers.cpu_kernels import cpu_kernels
from roseinfer.models.gguf_file import GGUFFile
from roseinfer.models.gguf_loader import model_config_from_gguf
from roseinfer.models.hf_config import model_config_from_hf

transformers = pytest.importorskip("transformers")

ORIGINAL = 32  # the models' original context
NEW_TOKENS = 32
SHORT_FACTOR = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5]
LONG_FACTOR = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]


def prompts(vocab: int) -> list[list[int]]:
    """Short (its generation crosses the original context), at the edge, and past it."""
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (6, 20, 32, 45)]


def _tokenizer(path: Path) -> int:
    vocab = write_default_tokenizer(path)
    # The converter reads a GPT-2-style tokenizer for Phi only when tokenizer_config says so (as
    # Phi-4-mini's does).
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"tokenizer_class": "GPT2Tokenizer"}))
    return vocab


def _save(model, path: Path, outtype: str = "f32") -> tuple[object, Path, Path]:
    model.eval().save_pretrained(path)
    return model, path, convert_hf_to_gguf(path, path.parent / f"{path.name}.gguf", outtype)


@pytest.fixture(scope="module")
def phi(tmp_path_factory):
    """Phi-4-mini's shape in small: partial rotary 0.75, LongRoPE, GQA, tied embeddings."""
    path = tmp_path_factory.mktemp("phi") / "phi3"
    vocab = _tokenizer(path)
    torch.manual_seed(0)
    config = transformers.Phi3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=ORIGINAL,
        partial_rotary_factor=0.75, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        initializer_range=0.2,  # larger weights than the default: tokens that vary (else one token repeats)
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": SHORT_FACTOR, "long_factor": LONG_FACTOR},
    )
    return _save(transformers.Phi3ForCausalLM(config), path)


@pytest.fixture(scope="module")
def qwen_yarn(tmp_path_factory):
    path = tmp_path_factory.mktemp("yarn") / "qwen3"
    vocab = write_default_tokenizer(path)
    torch.manual_seed(1)
    config = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False,
        initializer_range=0.2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": ORIGINAL, "beta_fast": 16.0, "beta_slow": 2.0},
    )
    return _save(transformers.Qwen3ForCausalLM(config), path)


@torch.no_grad()
def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """transformers' own decode loop: one forward for the prompt, then one per token, on its cache."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens = []
    for _ in range(steps):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def engine_tokens(llm: LLM, prompt_ids: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def phi_expected(phi):
    model = phi[0]
    return {tuple(p): hf_greedy(model, p, NEW_TOKENS) for p in prompts(model.config.vocab_size)}


# -- configuration from both files ---------------------------------------------------------------


def test_configs_read_partial_rotary_and_longrope(phi):
    _, hf_dir, gguf_path = phi
    from_hf, from_gguf = model_config_from_hf(hf_dir), model_config_from_gguf(GGUFFile(gguf_path))
    for config in (from_hf, from_gguf):
        assert config.architecture == "phi3"
        assert config.rotary_dim == 12 and config.head_dim == 16
        assert config.long_rope_from == ORIGINAL
        assert config.rope_scaling["rope_type"] == "longrope"
        assert config.rope_scaling["short_factor"] == pytest.approx(SHORT_FACTOR)
        assert config.rope_scaling["long_factor"] == pytest.approx(LONG_FACTOR)
    # What the converter wrote for the GGUF: the factor tensors and the rotary dimensions.
    meta = GGUFFile(gguf_path).metadata
    assert meta["phi3.rope.dimension_count"] == 12
    assert meta["phi3.rope.scaling.original_context_length"] == ORIGINAL
    assert GGUFFile(gguf_path).has_tensor("rope_factors_long.weight")


def test_configs_read_yarn(qwen_yarn):
    _, hf_dir, gguf_path = qwen_yarn
    meta = GGUFFile(gguf_path).metadata
    assert meta["qwen3.rope.scaling.type"] == "yarn" and meta["qwen3.rope.scaling.factor"] == 4.0
    for config in (model_config_from_hf(hf_dir), model_config_from_gguf(GGUFFile(gguf_path))):
        scaling = config.rope_scaling
        assert scaling["rope_type"] == "yarn" and scaling["factor"] == 4.0
        assert scaling["original_max_position_embeddings"] == ORIGINAL
        assert (scaling["beta_fast"], scaling["beta_slow"]) == (16.0, 2.0)
        assert config.long_rope_from is None


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16.0, "beta_slow": 2.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "attention_factor": 1.3,
     "truncate": False},
    {"rope_type": "longrope", "original_max_position_embeddings": 32, "short_factor": SHORT_FACTOR,
     "long_factor": LONG_FACTOR, "partial_rotary_factor": 0.75},
    {"rope_type": "longrope", "original_max_position_embeddings": 32, "short_factor": SHORT_FACTOR,
     "long_factor": LONG_FACTOR, "partial_rotary_factor": 0.75, "attention_factor": 1.1},
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
], ids=["yarn", "yarn-mscale", "yarn-attention-factor", "longrope", "longrope-factor",
        "linear", "llama3"])
def test_frequencies_equal_transformers(scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from roseinfer.layers.rotary import rope_frequencies

    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=128,
                                      rope_parameters={"rope_theta": 10000.0, **scaling})
    rotary_dim = int(16 * scaling.get("partial_rotary_factor", 1.0))
    ours = rope_frequencies(rotary_dim, 10000.0, dict(scaling), 128)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    assert torch.equal(ours.inv_freq, inv_freq)
    assert ours.attention_factor == pytest.approx(attention_factor, rel=1e-12)
    if scaling["rope_type"] == "longrope":
        long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=ORIGINAL + 1)
        assert torch.equal(ours.long_inv_freq, long_inv_freq) and ours.long_from == ORIGINAL


# -- tokens and logits against transformers ------------------------------------------------------


def test_the_prompts_tell_the_factors_apart(phi, phi_expected):
    """The comparisons below can fail: with the long factors replaced by the short ones (the same
    weights), transformers' own tokens change for the prompts that reach past the original context."""
    model = phi[0]
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.rope_parameters = {**config.rope_parameters, "long_factor": SHORT_FACTOR}
    short_only = transformers.Phi3ForCausalLM(config).eval()
    short_only.load_state_dict(model.state_dict())
    changed = [hf_greedy(short_only, list(p), NEW_TOKENS) != tokens for p, tokens in phi_expected.items()]
    assert any(changed), "no prompt depends on the long factors"
    assert len({t for tokens in phi_expected.values() for t in tokens}) > 8  # not one token repeated


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_phi3_greedy_tokens_match_transformers(phi, phi_expected, source):
    _, hf_dir, gguf_path = phi
    llm = LLM(str(hf_dir if source == "hf" else gguf_path), num_kv_blocks=128, **EXACT)
    got = engine_tokens(llm, [list(p) for p in phi_expected])
    assert got == list(phi_expected.values())


@pytest.mark.parametrize("which", ["phi", "qwen_yarn"])
def test_fused_decode_step_computes_the_scaled_rotary(request, which):
    """The C++ decode step takes the rotations the model computes (partial rotary, YaRN's and
    LongRoPE's attention factor, the long factors per sequence): its logits equal the op-by-op
    forward's, for a prompt whose decode steps cross the original context and one past it."""
    if cpu_kernels() is None:
        pytest.skip("no C++ kernels")
    from test_fused_decode import decode_logits_both_ways, quantizes_activations

    hf_dir = request.getfixturevalue(which)[1]
    engine = InferenceEngine(str(hf_dir), num_kv_blocks=64, quantization="int8")  # blocks: the C++ step applies
    worst, worst_kl = decode_logits_both_ways(engine, [[5, 9, 30], list(range(40, 68)), list(range(3, 43))], steps=6)
    assert worst_kl < 1e-3 if quantizes_activations() else worst < 1e-4, (worst, worst_kl)


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_yarn_greedy_tokens_match_transformers(qwen_yarn, source):
    model, hf_dir, gguf_path = qwen_yarn
    prompt_ids = prompts(model.config.vocab_size)
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in prompt_ids]
    llm = LLM(str(hf_dir if source == "hf" else gguf_path), num_kv_blocks=128, **EXACT)
    assert engine_tokens(llm, prompt_ids) == expected


@pytest.mark.parametrize("which", ["phi", "qwen_yarn"])
def test_logits_match_transformers_with_chunked_prefill(request, which):
    """Every sampled row's logits, prefill in chunks of 16 mixed with decodes. transformers
    recomputes the whole sequence for each row, so with LongRoPE each prompt stays on one side of
    the original context (6 + 6 tokens, 40 + 6 tokens)."""
    model, hf_dir, _ = request.getfixturevalue(which)
    generator = torch.Generator().manual_seed(5)
    prompt_ids = [torch.randint(3, model.config.vocab_size, (n,), generator=generator).tolist() for n in (6, 40)]
    engine = InferenceEngine(str(hf_dir), num_kv_blocks=64, max_num_batched_tokens=16, **EXACT)
    worst = compare_logits_step_by_step(engine, model, prompt_ids, 6)
    assert worst < 1e-4, f"{which}: max |logit difference| {worst}"


# -- engine features on Phi ----------------------------------------------------------------------


def test_phi3_chunked_prefill_and_preemption(phi, phi_expected):
    """Chunks of 8 tokens, and a pool too small for all four at once: preemption, recomputation."""
    _, hf_dir, _ = phi
    llm = LLM(str(hf_dir), num_kv_blocks=24, block_size=4, max_num_batched_tokens=8, **EXACT)
    got = engine_tokens(llm, [list(p) for p in phi_expected])
    assert got == list(phi_expected.values())
    assert llm.llm_engine.scheduler.stats.num_preemptions > 0
    assert llm.llm_engine.kv_cache.num_free_blocks == llm.llm_engine.kv_cache.num_blocks


def test_phi3_prefix_cache_never_mixes_short_and_long_rotations(phi):
    """A short prompt's blocks (keys rotated with the short factors) are not reused by a longer
    prompt that starts with it (the long factors throughout); two long prompts share theirs."""
    model, hf_dir, _ = phi
    generator = torch.Generator().manual_seed(7)
    short = torch.randint(3, model.config.vocab_size, (24,), generator=generator).tolist()
    long = short + torch.randint(3, model.config.vocab_size, (20,), generator=generator).tolist()
    llm = LLM(str(hf_dir), num_kv_blocks=128, block_size=4, enable_prefix_caching=True, **EXACT)
    stats = llm.llm_engine.kv_cache.prefix_stats
    assert engine_tokens(llm, [short]) == [hf_greedy(model, short, NEW_TOKENS)]
    hits = stats.hits
    assert engine_tokens(llm, [long]) == [hf_greedy(model, long, NEW_TOKENS)]
    assert stats.hits == hits  # nothing of the short prompt's
    other_long = long[:40] + [5, 6, 7, 8, 9]
    assert engine_tokens(llm, [other_long]) == [hf_greedy(model, other_long, NEW_TOKENS)]
    assert stats.hits >= hits + 40 - 4  # the first long prompt's blocks


def test_phi3_two_ranks_match_one(phi):
    from test_tensor_parallel import PROMPTS, compare_logits, generate, make_core

    _, hf_dir, _ = phi
    # Past the original context too: the long factors on both ranks.
    prompt_ids = [*PROMPTS[:4], list(range(3, 3 + 44))]
    reference = make_core(hf_dir)
    tp_core = make_core(hf_dir, tensor_parallel_size=2)
    try:
        assert compare_logits(reference, tp_core.executor, prompt_ids, max_tokens=4) < 1e-4
        expected = generate(reference, prompt_ids, 8, "one")
        assert generate(tp_core, prompt_ids, 8, "two") == expected
        assert tp_core.kv_cache.num_free_blocks == tp_core.kv_cache.num_blocks
    finally:
        tp_core.shutdown()


# -- the rest ------------------------------------------------------------------------------------


def test_unknown_rope_scaling_is_named(tmp_path):
    config = {"model_type": "qwen2", "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 1,
              "num_attention_heads": 2, "intermediate_size": 32,
              "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="rope scaling type 'dynamic' is not supported"):
        model_config_from_hf(tmp_path)

    path = tmp_path / "scaled.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in (("embedding_length", 16), ("block_count", 1), ("feed_forward_length", 32),
                       ("context_length", 64), ("attention.head_count", 2)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_string("llama.rope.scaling.type", "dynamic")
    writer.add_tensor("token_embd.weight", np.zeros((32, 16), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="rope scaling type 'dynamic' is not supported"):
        model_config_from_gguf(GGUFFile(path))


# Phi-3-mini-instruct's and Phi-4-mini-instruct's chat templates (from their tokenizer_config.json).
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
PHI4_MINI_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and message['tools'] "
    "is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + "
    "'<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)


@pytest.mark.parametrize("template", [PHI3_TEMPLATE, PHI4_MINI_TEMPLATE], ids=["phi3", "phi4-mini"])
def test_phi_chat_templates_render_as_transformers(phi, template):
    from roseinfer.tokenizer import Tokenizer

    hf_dir = phi[1]
    conversations = [
        ([{"role": "user", "content": "What is 2+2?"}], {}),
        ([{"role": "system", "content": "You are terse.", "tools": '[{"name": "f"}]'},
          {"role": "user", "content": "Café? 漢字"}, {"role": "assistant", "content": "Yes.\nNo."},
          {"role": "user", "content": "Again."}], {}),
    ]
    rendered = assert_chat_renders_as_transformers(
        Tokenizer.from_pretrained_dir(hf_dir), transformers.AutoTokenizer.from_pretrained(hf_dir), template,
        conversations,
    )
    assert rendered == 4
