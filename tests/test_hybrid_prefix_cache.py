"""Prefix caching on hybrid models (core/kv_cache/recurrent_state.py's state snapshots): a tiny
random Qwen3.5 (Gated DeltaNet) and Granite 4 (Mamba2) from transformers' own classes. A
conversation grown by a turn resumes from the snapshot at the last full block of the turn before
(fewer prompt tokens computed) and its greedy tokens and logits are transformers' and the uncached
engine's; with prompts prefilled in chunks cut by a small budget, preemption, and a snapshot pool
of one slot whose snapshots are evicted, every answer stays transformers'."""

from __future__ import annotations

import logging

import pytest
import torch
from support import EXACT, compare_logits_step_by_step
from test_hybrid_models import TinyHybrid

from roseinfer import LLM, SamplingParams

BLOCK = 16
TOKENS = 6


@pytest.fixture(scope="module", params=["qwen3_5", "granite"])
def hybrid(request, tmp_path_factory) -> TinyHybrid:
    return TinyHybrid(request.param, tmp_path_factory.mktemp("hybrid_prefix"), gguf=False)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """Greedy tokens and the number of prompt tokens found in the prefix cache, per prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [(list(output.outputs[0].token_ids), output.metrics.num_cached_tokens) for output in outputs]


@torch.no_grad()
def _reference(model, prompt: list[int]) -> list[int]:
    model.generation_config.eos_token_id = None
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=TOKENS, do_sample=False, pad_token_id=0)
    return ids[0, len(prompt):].tolist()


def _conversation(hybrid: TinyHybrid) -> list[list[int]]:
    """Three turns: each the one before, its answer (transformers') and a new user message."""
    generator = torch.Generator().manual_seed(7)
    turns = [hybrid.prompts[3] + torch.randint(3, 200, (30,), generator=generator).tolist()]  # 70 tokens
    for length in (21, 9):
        turns.append(turns[-1] + _reference(hybrid.reference, turns[-1]) + torch.randint(
            3, 200, (length,), generator=generator).tolist())
    return turns


def test_a_growing_conversation_resumes_from_its_last_turn(hybrid, caplog):
    turns = _conversation(hybrid)
    expected = [_reference(hybrid.reference, turn) for turn in turns]
    with caplog.at_level(logging.INFO, logger="roseinfer"):
        llm = LLM(str(hybrid.hf_dir), dtype="float32", block_size=BLOCK, **EXACT)
    assert "snapshots of the recurrent state" in caplog.text
    got = [_generate(llm, [turn])[0] for turn in turns]
    assert [tokens for tokens, _ in got] == expected
    # Each turn resumes at the last full block of the turn before (its prompt's snapshot).
    assert [cached for _, cached in got] == [0] + [len(turn) // BLOCK * BLOCK for turn in turns[:-1]]
    plain = LLM(str(hybrid.hf_dir), dtype="float32", block_size=BLOCK, enable_prefix_caching=False, **EXACT)
    assert [tokens for tokens, _ in _generate(plain, turns)] == expected
    # Teacher-forced logits of a fourth turn that resumes from the third's snapshot.
    fourth = turns[-1] + expected[-1] + [5, 6, 7]
    hits = llm.llm_engine.scheduler.make_stats().prefix_cache_hits
    worst = compare_logits_step_by_step(llm.engine, hybrid.reference, [fourth], 2)
    assert llm.llm_engine.scheduler.make_stats().prefix_cache_hits - hits == len(turns[-1]) // BLOCK * BLOCK
    assert worst < 1e-3, f"max |logit difference| {worst}"


def test_chunks_preemption_and_evicted_snapshots_stay_right(hybrid):
    """Prompts that share a prefix, prefilled 24 tokens a step (chunks cut at block boundaries,
    each end snapshotted), in a KV pool small enough to preempt, with one snapshot slot: snapshots
    are evicted by newer ones, hits come only from the one kept, and every answer is transformers'."""
    base = hybrid.prompts[2]  # 150 tokens
    prompts = [base, base[:100] + [9, 8, 7], base + [4, 5], base[:40]]
    expected = [_reference(hybrid.reference, prompt) for prompt in prompts]
    llm = LLM(str(hybrid.hf_dir), dtype="float32", block_size=BLOCK, max_num_batched_tokens=24, num_kv_blocks=14,
              num_state_snapshots=1, **EXACT)
    assert [tokens for tokens, _ in _generate(llm, prompts)] == expected
    assert llm.llm_engine.scheduler.stats.num_preemptions > 0
    kv = llm.llm_engine.scheduler.kv_cache
    kv.check_invariants()
    assert kv.state.num_snapshots == 1 and len(kv.state.snapshots) == 1
    # One at a time: a prompt's last snapshot evicts the one before, so only the last prompt's
    # last full block resumes (and its KV blocks cached further do not make a longer hit).
    runs = []
    for prompt in (prompts[1], prompts[1] + [3], base[:40] + [1, 2], base + [11, 12]):
        tokens, cached = _generate(llm, [prompt])[0]
        assert tokens == _reference(hybrid.reference, prompt)
        runs.append(cached)
    assert runs[1:] == [96, 0, 32]
    kv.check_invariants()


def test_too_costly_snapshots_turn_prefix_caching_off(hybrid, caplog):
    if hybrid.kind != "qwen3_5":
        pytest.skip("one family is enough")
    with caplog.at_level(logging.INFO, logger="roseinfer"):
        llm = LLM(str(hybrid.hf_dir), dtype="float32", num_state_snapshots=0, **EXACT)
    assert "prefix caching is off" in caplog.text
    turn = hybrid.prompts[2]
    assert [_generate(llm, [turn])[0] for _ in range(2)] == [(hybrid.expected[2][:TOKENS], 0)] * 2
