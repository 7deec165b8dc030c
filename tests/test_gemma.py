"""Gemma 2 / Gemma 3 (text) and sliding-window attention against transformers (float32, eager
attention: the reference that applies Gemma 2's soft-cap).

Tiny random models built by transformers' own classes, with a sliding window (12) shorter than
some prompts, saved as Hugging Face directories and converted to GGUF by llama.cpp's converter
(tests/hf_to_gguf.py). Logits of prefill (whole and chunked) and decode steps within float32
tolerance, greedy tokens identical for 32 tokens, through both the C++ decode kernel and the
PyTorch path; prefix caching and preemption on Gemma; Mistral and Qwen2 sliding windows past the
window; Gemma 2, Gemma 3 and Mistral on two tensor-parallel ranks as on one. Gemma's decode steps
run through the fused C++ step (models/fused_decode.py), checked against the op-by-op forward with
float weights, bfloat16, int8/int4 blocks and a Q8_0 GGUF file.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import transformers
from hf_to_gguf import convert_hf_to_gguf, llama_cpp_chat_template, write_default_tokenizer
from support import CORPUS, assert_chat_renders_as_transformers, compare_logits_step_by_step
from test_fused_decode import decode_logits_both_ways, panel_dtypes, quantizes_activations

from roseinfer import LLM
from roseinfer.common.kv_cache_spec import sliding_blocks_per_sequence
from roseinfer.core.kv_cache import RELEASED
from roseinfer.core.kv_pool_plan import plan_engine
from roseinfer.sampling_params import SamplingParams
from roseinfer.tokenizer import Tokenizer

TOLERANCE = 1e-3
WINDOW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def _prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (5, 11, 40)]


def _sentencepiece_model(path: Path, symbols: tuple[str, ...] = ()) -> None:
    """llama.cpp's Gemma 2 converter reads the vocabulary from a sentencepiece tokenizer.model (the
    model's ids are what is compared, not its text): one trained on the test corpus, with
    `symbols` as whole tokens."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, vocab_size=400, model_type="bpe",
        byte_fallback=True, minloglevel=2, **({"user_defined_symbols": list(symbols)} if symbols else {}),
    )
    path.write_bytes(model.getvalue())


def _build(kind: str, path: Path) -> None:
    vocab = write_default_tokenizer(path)
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=512, sliding_window=WINDOW, eos_token_id=2, bos_token_id=1,
        pad_token_id=0,
    )
    if kind == "gemma2":  # global and local layers alternate; both soft-caps on
        config = transformers.Gemma2Config(
            num_hidden_layers=3, query_pre_attn_scalar=32, attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0, **common,
        )
        _sentencepiece_model(path / "tokenizer.model")
    elif kind == "gemma3":  # llama.cpp's pattern: five local layers, then a global one
        config = transformers.Gemma3TextConfig(
            num_hidden_layers=6, query_pre_attn_scalar=32,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
            **common,
        )
    elif kind == "gemma3-hf":  # Hugging Face only: own layer pattern and query scale
        config = transformers.Gemma3TextConfig(
            num_hidden_layers=3, query_pre_attn_scalar=48, final_logit_softcapping=4.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], **common,
        )
    elif kind == "mistral":
        config = transformers.MistralConfig(num_hidden_layers=2, **common)
    elif kind == "qwen2":  # layer 0 global, layer 1 sliding
        config = transformers.Qwen2Config(
            num_hidden_layers=2, use_sliding_window=True, max_window_layers=1,
            **{k: v for k, v in common.items() if k != "head_dim"},
        )
    else:
        raise ValueError(kind)
    config.initializer_range = 0.1
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, parameter in model.named_parameters():  # Gemma initialises its norms to 0 (scale 1)
        if name.endswith("norm.weight"):
            torch.nn.init.normal_(parameter, 0.0, 0.3)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma")
    paths = {}
    for kind in ("gemma2", "gemma3", "gemma3-hf", "mistral", "qwen2"):
        _build(kind, root / kind)
        paths[kind] = root / kind
    for kind in ("gemma2", "gemma3"):
        paths[f"{kind}.gguf"] = convert_hf_to_gguf(root / kind, root / f"{kind}.gguf")
        paths[f"{kind}.q8_0.gguf"] = convert_hf_to_gguf(root / kind, root / f"{kind}.q8_0.gguf", "q8_0")
    return paths


def _reference(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@torch.no_grad()
def _greedy_reference(reference, prompts: list[list[int]]) -> list[list[int]]:
    """32 greedy tokens each, end-of-sequence ignored (as GREEDY's ignore_eos)."""
    reference.generation_config.eos_token_id = None
    outputs = []
    for prompt in prompts:
        ids = reference.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=0)
        assert ids.shape[1] == len(prompt) + 32
        outputs.append(ids[0, len(prompt):].tolist())
    return outputs


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


@pytest.mark.parametrize(
    ("kind", "source"),
    [("gemma2", "hf"), ("gemma2", "gguf"), ("gemma3", "hf"), ("gemma3", "gguf"), ("gemma3-hf", "hf"),
     ("mistral", "hf"), ("qwen2", "hf")],
)
def test_logits_and_greedy_tokens_match_transformers(models, kind, source):
    reference = _reference(models[kind])
    prompts = _prompts(reference.config.vocab_size)
    model = str(models[f"{kind}.gguf"] if source == "gguf" else models[kind])
    # The gemma2 file's own sentencepiece vocabulary (400 pieces, trained for the converter) is
    # smaller than the model's: its outputs are decoded with the directory's tokenizer. (The gemma3
    # file has the BPE of the directory.)
    extra = {"tokenizer": str(models[kind])} if source == "gguf" and kind == "gemma2" else {}
    # A small token budget: the 40-token prompt is prefilled in chunks past the window.
    llm = LLM(model, num_kv_blocks=64, max_num_batched_tokens=16, quantization="none", **extra)
    config = llm.llm_engine.model_config
    assert config.sliding_window == WINDOW and config.context_length == 512
    worst = compare_logits_step_by_step(llm.engine, reference, prompts, 2)
    assert worst < TOLERANCE, f"{kind} ({source}): max |logit difference| {worst}"

    expected = _greedy_reference(reference, prompts)
    if "float32" in panel_dtypes():  # the decode steps ran in the fused C++ step, not op by op
        assert llm.llm_engine.model_runner.fused_decoder is not None, f"{kind} ({source}): no fused decode step"
    assert _greedy(llm, prompts) == expected, f"{kind} ({source}), C++ decode kernel"
    if source == "hf" and kind != "mistral":  # SDPA with the window's mask, Gemma 2's soft-capped math
        torch_llm = LLM(model, num_kv_blocks=64, attention_backend="torch", quantization="none")
        assert _greedy(torch_llm, prompts) == expected, f"{kind} ({source}), PyTorch attention"


# More rows than one parallel task of the C++ step's elementwise passes takes (16).
MANY_PROMPTS = [[(7 * i + j) % 300 + 3 for j in range(3 + i)] for i in range(14)]


@pytest.mark.parametrize(("kind", "weights"), [
    ("gemma2", "float32"), ("gemma3", "float32"), ("gemma3-hf", "float32"), ("gemma2", "bfloat16"),
    ("gemma3", "bfloat16"), ("gemma2", "int8"), ("gemma3", "int4"), ("gemma2", "q8_0.gguf"), ("gemma3", "q8_0.gguf"),
])
def test_fused_decode_step_equals_the_op_by_op_forward(models, kind, weights):
    """Gemma's decode steps in the fused C++ step (its GeGLU, four norms a layer, scaled embeddings,
    soft-caps, query scale, a window and a rotary table per layer) against the op-by-op forward,
    past the sliding window: logits within the Llama family's tolerances (the q/k norms of
    Gemma 3 run in PyTorch op by op, as Qwen3's), and the runner really holds the fused step."""
    if weights in ("float32", "bfloat16") and weights not in panel_dtypes():
        pytest.skip(f"this CPU's build has no {weights} panel kernel: no fused decode step for float weights")
    if weights.endswith(".gguf"):
        # The gemma2 file's own vocabulary is smaller than the model's: the directory's tokenizer
        options = {"tokenizer": str(models[kind])} if kind == "gemma2" else {}
        llm = LLM(str(models[f"{kind}.{weights}"]), num_kv_blocks=128, num_kv_blocks_sliding=96, **options)
    elif weights in ("float32", "bfloat16"):
        llm = LLM(str(models[kind]), num_kv_blocks=128, num_kv_blocks_sliding=96, quantization="none", dtype=weights)
    else:
        llm = LLM(str(models[kind]), num_kv_blocks=128, num_kv_blocks_sliding=96, quantization=weights)
    runner = llm.llm_engine.model_runner
    fused = runner.fused_decoder
    assert fused is not None, "Gemma decodes op by op"
    # Two KV cache groups, pools of different sizes: a layer read through the other group's
    # tables would read other blocks than it wrote.
    assert runner.group_windows == [None, WINDOW] and len(set(runner.group_num_blocks)) == 2
    assert fused.decoder.rotary_tables() == (1 if runner.model.same_rotary else 2)
    prompts = _prompts(llm.llm_engine.model_config.vocab_size) + MANY_PROMPTS
    assert max(map(len, prompts)) > WINDOW
    worst, worst_kl = decode_logits_both_ways(llm.engine, prompts, steps=5)
    if weights == "float32" or (weights not in ("bfloat16", "float32") and not quantizes_activations()):
        assert worst < 1e-4, worst
    else:  # bfloat16, or 8-bit activations: a last-bit difference may cross a rounding step
        assert worst_kl < 1e-3, (worst, worst_kl)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_gemma_local_layers_hold_at_most_their_window(models, backend):
    """Gemma 3 (five local layers to one global): three prompts (40 tokens past the window of 12)
    prefilled in chunks of 8 and 32 greedy tokens each, in blocks of 4. After every step each
    request's sliding-group table holds at most the window's bound of blocks while its full-group
    table covers every token; the sliding layers' pools have the bound's blocks (not the
    context's); the tokens are transformers'."""
    reference = _reference(models["gemma3"])
    prompts = _prompts(reference.config.vocab_size)
    llm = LLM(str(models["gemma3"]), block_size=4, max_num_batched_tokens=8, max_num_seqs=3,
              attention_backend=backend, quantization="none")
    engine = llm.llm_engine
    full, sliding = engine.kv_cache.groups
    bound = sliding_blocks_per_sequence(WINDOW, 8, 4)
    assert sliding.num_blocks == 3 * bound and full.num_blocks == 3 * 512 // 4
    runner = engine.model_runner
    windows = engine.model_config.layer_windows
    assert [cache.shape[1] for cache in runner.kv_caches] == [sliding.num_blocks if w else full.num_blocks
                                                              for w in windows]
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, GREEDY)
    tokens: list[list[int]] = [[] for _ in prompts]
    most_held = longest = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[int(output.request_id)] = list(output.outputs[0].token_ids)
        engine.kv_cache.check_invariants()
        for request_id, table in full.block_tables.items():
            assert RELEASED not in table
            most_held = max(most_held, sum(block != RELEASED for block in sliding.block_tables[request_id]))
            longest = max(longest, len(table))
    assert most_held <= bound < longest == -(-(40 + 31) // 4)
    assert tokens == _greedy_reference(reference, prompts)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_a_gemma_prefix_hit_past_the_window_gives_the_same_tokens(models):
    """A second request sharing a 40-token prefix (past the window) with a finished one: its
    cached tokens cover blocks of both groups (the sliding group's from the window before the
    hit), and its greedy tokens are transformers'."""
    reference = _reference(models["gemma2"])
    shared = _prompts(reference.config.vocab_size)[2]
    llm = LLM(str(models["gemma2"]), block_size=4, max_num_batched_tokens=16, quantization="none")
    first = llm.generate(prompt_token_ids=[shared + [5]], sampling_params=GREEDY, use_tqdm=False)[0]
    second = llm.generate(prompt_token_ids=[shared + [9, 10]], sampling_params=GREEDY, use_tqdm=False)[0]
    assert first.metrics.num_cached_tokens == 0 and second.metrics.num_cached_tokens == 40
    expected = _greedy_reference(reference, [shared + [5], shared + [9, 10]])
    assert [list(first.outputs[0].token_ids), list(second.outputs[0].token_ids)] == expected
    engine = llm.llm_engine
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    engine.kv_cache.check_invariants()


def test_gemma_preempts_when_its_sliding_pool_runs_out(models):
    """A sliding pool of 8 blocks of 4 (room for one sequence's window and a bit) under three
    requests, each sampled twice (n=2: the siblings share the prompt's blocks in both groups and
    copy the last one): requests are preempted and recomputed, and every sequence's greedy tokens
    are transformers'."""
    reference = _reference(models["gemma3"])
    prompts = _prompts(reference.config.vocab_size)
    bound = sliding_blocks_per_sequence(WINDOW, 8, 4)
    llm = LLM(str(models["gemma3"]), block_size=4, max_num_batched_tokens=8, max_num_seqs=3,
              num_kv_blocks_sliding=bound + 2, quantization="none")
    engine = llm.llm_engine
    assert engine.kv_cache.groups[0].num_blocks == 3 * 512 // 4, "the full pool is not what runs out"
    params = SamplingParams(n=2, temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    expected = _greedy_reference(reference, prompts)
    assert [[list(c.token_ids) for c in output.outputs] for output in outputs] == [[e, e] for e in expected]
    assert engine.scheduler.stats.num_preemptions > 0, "the sliding pool was meant to be too small"
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    engine.kv_cache.check_invariants()


def test_kv_cache_memory_is_shared_by_the_two_pools(models):
    """Memory-based sizing: the pools grow together (a sequence never holds more sliding blocks than
    full ones) up to max_num_seqs x the window bound's sliding blocks, then the full-attention pool
    takes the rest; with memory for fewer, both get the same count and max_model_len is lowered;
    with num_kv_blocks given, the sliding pool is no larger. (A Gemma 3 4B at the defaults asked for
    31 GB of sliding pool when it was sized for max_num_seqs windows whatever the memory.)"""
    from roseinfer import EngineConfig
    from roseinfer.models.hf_config import model_config_from_hf

    model = model_config_from_hf(models["gemma3"])  # five sliding layers, one full
    per_sequence = sliding_blocks_per_sequence(WINDOW, 8, 4)
    full, sliding = (model.kv_block_bytes(4, torch.float32, num_layers=n) for n in (1, 5))

    def resolved(**kwargs) -> EngineConfig:
        config = EngineConfig(block_size=4, max_num_batched_tokens=8, max_num_seqs=2, **kwargs)
        plan_engine(config, model)
        return config

    roomy = resolved(kv_cache_memory=(2 * per_sequence * (full + sliding) + 10 * full) / 1024**3)
    assert (roomy.num_kv_blocks_sliding, roomy.num_kv_blocks) == (2 * per_sequence, 2 * per_sequence + 10)
    tight = resolved(kv_cache_memory=(per_sequence + 1) * (full + sliding) / 1024**3)
    assert (tight.num_kv_blocks_sliding, tight.num_kv_blocks) == (per_sequence + 1, per_sequence + 1)
    assert tight.max_model_len == (per_sequence + 1) * 4
    assert resolved(num_kv_blocks=9).num_kv_blocks_sliding == 9
    assert resolved(num_kv_blocks=100).num_kv_blocks_sliding == 2 * per_sequence


def test_num_kv_blocks_sliding_is_for_models_with_both_kinds_of_layers(models):
    """Sets the sliding layers' pool of a Gemma; refused by name below one sequence's window
    bound, and for Mistral (every layer alike)."""
    llm = LLM(str(models["gemma2"]), num_kv_blocks=40, num_kv_blocks_sliding=36, quantization="none")
    assert [group.num_blocks for group in llm.llm_engine.kv_cache.groups] == [40, 36]
    with pytest.raises(ValueError, match="num_kv_blocks_sliding 2 is fewer than one sequence"):
        LLM(str(models["gemma2"]), num_kv_blocks_sliding=2, quantization="none")
    with pytest.raises(ValueError, match="num_kv_blocks_sliding applies to a model with both"):
        LLM(str(models["mistral"]), num_kv_blocks_sliding=24, quantization="none")


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_a_windowed_model_runs_sequences_longer_than_its_pool(models, backend):
    """Mistral (a window on every layer): blocks that fall out of the window are released, so
    72-token sequences (prompt 40 + 32 generated) run in a pool of 8 blocks of 4 tokens, three at a
    time (preempted and recomputed when the pool runs out), with transformers' greedy tokens."""
    reference = _reference(models["mistral"])
    prompts = _prompts(reference.config.vocab_size)
    llm = LLM(str(models["mistral"]), block_size=4, num_kv_blocks=8, max_num_batched_tokens=8, max_num_seqs=3,
              attention_backend=backend, quantization="none")
    engine = llm.llm_engine
    assert [group.attention_span for group in engine.kv_cache.groups] == [WINDOW]
    assert engine.config.max_model_len == 512, "the pool bounds a windowed sequence's span, not its length"
    assert _greedy(llm, prompts) == _greedy_reference(reference, prompts)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    engine.kv_cache.check_invariants()


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "mistral"])
def test_two_ranks_match_one(models, kind):
    """Gemma 2 (soft-caps) and Gemma 3 (q/k norms, a rotary table per kind of layer) with their local
    and global layers, and Mistral's window on every layer, on two ranks (one KV head each): every
    sampled row's logits within 1e-4 of one rank's, prefill in chunks past the window, and the same
    greedy tokens, transformers' own."""
    from test_tensor_parallel import compare_logits, generate, make_core

    reference_model = _reference(models[kind])
    prompts = _prompts(reference_model.config.vocab_size)
    reference = make_core(models[kind], quantization="none")
    tp_core = make_core(models[kind], tensor_parallel_size=2, quantization="none")
    try:
        executor = tp_core.executor
        assert [s["kv_heads"] for s in executor.collective_rpc("cache_state")] == [1, 1]
        assert compare_logits(reference, executor, prompts, max_tokens=4) < 1e-4
        got = generate(tp_core, prompts, 8, "two")
        expected = [tokens[:8] for tokens in _greedy_reference(reference_model, prompts)]
        assert [got[f"-{i}"] for i in range(len(prompts))] == expected
        assert tp_core.kv_cache.num_free_blocks == tp_core.kv_cache.num_blocks
    finally:
        tp_core.shutdown()


def test_gemma_config_from_both_files(models):
    from roseinfer.models.gguf_file import GGUFFile
    from roseinfer.models.gguf_loader import model_config_from_gguf
    from roseinfer.models.hf_config import model_config_from_hf

    for kind in ("gemma2", "gemma3"):
        hf, gguf = model_config_from_hf(models[kind]), model_config_from_gguf(GGUFFile(models[f"{kind}.gguf"]))
        for field in ("architecture", "layer_types", "sliding_window", "attn_logit_softcapping",
                      "final_logit_softcapping", "query_pre_attn_scalar", "rope_theta", "rope_local_theta",
                      "rope_scaling", "qk_norm", "num_layers", "head_dim"):
            assert getattr(hf, field) == getattr(gguf, field), f"{kind}: {field}"
    gemma2 = model_config_from_hf(models["gemma2"])
    assert gemma2.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert gemma2.attn_logit_softcapping == 5.0 and gemma2.final_logit_softcapping == 3.0


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gguf_stops_where_the_checkpoint_does(tmp_path, kind):
    """An instruct Gemma's generation_config.json ends generation at <end_of_turn> as well as <eos>
    (gemma-2-2b-it: [1, 107]); llama.cpp's converter writes only <eos> to the GGUF file (and finds
    <end_of_turn> by its text when it loads one). Ours finds it too: the converted file stops where
    the Hugging Face checkpoint does."""
    import json

    import sentencepiece

    from roseinfer.models.gguf_file import GGUFFile
    from roseinfer.models.gguf_loader import model_config_from_gguf
    from roseinfer.models.hf_config import model_config_from_hf

    hf = tmp_path / kind
    hf.mkdir()
    _sentencepiece_model(hf / "tokenizer.model", ("<start_of_turn>", "<end_of_turn>"))
    vocab = sentencepiece.SentencePieceProcessor(model_file=str(hf / "tokenizer.model"))
    end_of_turn = vocab.piece_to_id("<end_of_turn>")
    common = dict(vocab_size=vocab.get_piece_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, eos_token_id=vocab.eos_id(),
                  bos_token_id=vocab.bos_id(), pad_token_id=vocab.pad_id() if vocab.pad_id() >= 0 else 0)
    config = transformers.Gemma2Config(**common) if kind == "gemma2" else transformers.Gemma3TextConfig(**common)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(hf)
    (hf / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": vocab.bos_id(), "eos_token_id": [vocab.eos_id(), end_of_turn]}
    ))
    gguf = GGUFFile(convert_hf_to_gguf(hf, tmp_path / f"{kind}.gguf"))
    assert gguf.metadata["tokenizer.ggml.tokens"][end_of_turn] == "<end_of_turn>"
    assert "tokenizer.ggml.eot_token_id" not in gguf.metadata  # what the converter leaves out
    hf_config, gguf_config = model_config_from_hf(hf), model_config_from_gguf(gguf)
    assert sorted(hf_config.eos_token_ids) == [vocab.eos_id(), end_of_turn]
    assert sorted(gguf_config.eos_token_ids) == sorted(hf_config.eos_token_ids)


def test_prefix_caching_and_preemption_on_gemma(models):
    """Prompts sharing a prefix longer than the window (cached blocks reused), in a pool too small
    for all of them at once (preemption and recomputation): the same greedy tokens as transformers."""
    reference = _reference(models["gemma3"])
    prompts = _prompts(reference.config.vocab_size)
    shared = prompts[2]
    batch = [shared + [7, 8], shared + [9], shared + [30, 31, 32], prompts[1]]
    expected = _greedy_reference(reference, batch)
    llm = LLM(str(models["gemma3"]), num_kv_blocks=12, max_num_seqs=4, quantization="none")
    first = _greedy(llm, [batch[0]])
    assert first == expected[:1]
    assert _greedy(llm, batch) == expected
    engine = llm.llm_engine
    assert engine.kv_cache.prefix_stats.hits > 0, "the shared prefix was meant to be cached"
    assert engine.scheduler.stats.num_preemptions > 0, "the pool was meant to be too small"
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    engine.kv_cache.check_invariants()


def test_decode_kernel_window_and_softcap_match_pytorch():
    """The C++ kernel's window and soft-cap against the plain math, over several block offsets."""
    from roseinfer.layers.cpu_kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ kernels")
    torch.manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 64, 16
    pool = torch.randn(2, 20, block, kv_heads, dim)
    tables = torch.randperm(20)[:10].view(2, 5)
    lengths = torch.tensor([70, 33])
    q = torch.randn(2, heads, dim)
    for window, softcap in ((0, 0.0), (12, 0.0), (16, 2.0), (40, 0.0), (100, 1.5), (1, 0.0)):
        out = kernels.paged_decode_attention(q, pool[0], pool[1], tables, lengths, 0.125, window, softcap)
        for row in range(2):
            n = int(lengths[row])
            keys = pool[0][tables[row]].reshape(-1, kv_heads, dim)[:n].repeat_interleave(2, 1)
            values = pool[1][tables[row]].reshape(-1, kv_heads, dim)[:n].repeat_interleave(2, 1)
            scores = torch.einsum("hd,thd->ht", q[row], keys) * 0.125
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            if window:
                scores[:, : max(0, n - window)] = float("-inf")
            expected = torch.einsum("ht,thd->hd", scores.softmax(-1), values)
            assert torch.allclose(out[row], expected, atol=1e-5), (window, softcap, row)



def test_gemma_chat_template_renders_as_transformers(smollm_tokenizer, smollm_hf_tokenizer):
    """Gemma 2's own template (from llama.cpp's collection): turns as <start_of_turn>user/model,
    trimmed contents, alternating roles enforced, no system role (its text placed in the first user
    turn, as transformers renders that placement)."""
    conversations = [
        ([{"role": "user", "content": "What is 2+2? "}], {}),
        ([{"role": "user", "content": "Hi! Café? 漢字"}, {"role": "assistant", "content": " Hello.\nHow can I help?"},
          {"role": "user", "content": "A joke."}], {}),
        ([{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}], {}),
    ]
    template = llama_cpp_chat_template("google-gemma-2-2b-it")
    assert assert_chat_renders_as_transformers(smollm_tokenizer, smollm_hf_tokenizer, template, conversations) == 4
    # The system turn the template refuses ("System role not supported") opens the first user turn,
    # as transformers renders that placement (checked above).
    ours = Tokenizer(smollm_tokenizer.backend, chat_template=template, eos_token=smollm_tokenizer.eos_token)
    assert ours.apply_chat_template(conversations[2][0]).startswith("<start_of_turn>user\nterse")


def test_speculative_decoding_on_gemma_gives_transformers_tokens(models):
    """N-gram speculation on Gemma 3 (five sliding layers to one global), prompts that repeat
    themselves past the window of 12 in blocks of 4: drafts are proposed and some accepted,
    rejected ones are dropped from both KV cache groups, and every greedy token is transformers'
    (one pool small enough to preempt, so recomputation runs beside speculation too)."""
    reference = _reference(models["gemma3"])
    base = _prompts(reference.config.vocab_size)
    prompts = [base[1] * 4, base[0] * 6 + base[2], base[2]]  # 44, 70 and 40 tokens
    expected = _greedy_reference(reference, prompts)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    for blocks in (None, 40):
        sizing = {"num_kv_blocks": blocks} if blocks else {}
        llm = LLM(str(models["gemma3"]), block_size=4, max_num_batched_tokens=16, max_num_seqs=3,
                  speculative_config=spec, quantization="none", **sizing)
        assert _greedy(llm, prompts) == expected, f"num_kv_blocks={blocks}"
        engine = llm.llm_engine
        stats = engine.scheduler.stats
        assert stats.num_draft_tokens > stats.num_accepted_tokens > 0, "drafts were meant to be proposed and some taken"
        if blocks:
            assert stats.num_preemptions > 0, "the pool was meant to be too small"
        assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
        engine.kv_cache.check_invariants()
