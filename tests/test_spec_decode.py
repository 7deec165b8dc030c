"""Speculative decoding with n-gram drafts: greedy output token-identical to transformers (and so
to no speculation) on the 8 chat prompts and on prompts that quote text, also under preemption,
every block free afterwards; and the acceptance rule checked statistically on a real model's
next-token distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats
from support import EXACT

from roseinfer import LLM, SamplingParams
from roseinfer.worker.spec_decode import verify_drafts

NEW_TOKENS = 32
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
        "disable_by_batch_size": 16}
QUOTED = [
    "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat.",
    "Fix the typo and repeat the code:\ndef add(a, b):\n    retrun a + b\n\ndef sub(a, b):\n    return a - b\n",
]


@pytest.fixture(scope="module")
def prompts(default_llm, chat_prompt_ids) -> list[list[int]]:
    tokenizer = default_llm.get_tokenizer()
    quoted = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]),
                               add_special_tokens=False) for q in QUOTED]
    return chat_prompt_ids + quoted


@pytest.fixture(scope="module")
def reference(hf_default_model, prompts) -> list[list[int]]:
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            out = hf_default_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                            eos_token_id=2, pad_token_id=2)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


def greedy_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=NEW_TOKENS),
                           use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("kv_blocks", [None, 14])
def test_greedy_is_token_identical_with_speculation(prompts, reference, kv_blocks):
    llm = LLM(speculative_config=SPEC, max_num_seqs=10, **EXACT,
              **({"num_kv_blocks": kv_blocks} if kv_blocks else {"kv_cache_memory": 0.25}))
    assert greedy_tokens(llm, prompts) == reference
    one_by_one = [greedy_tokens(llm, [p])[0] for p in prompts[-2:]]  # alone: a batch under the size limit
    assert one_by_one == reference[-2:]
    engine = llm.llm_engine
    scheduler_stats = engine.scheduler.stats
    assert scheduler_stats.num_accepted_tokens > 0, "the quoted prompts were meant to give accepted drafts"
    assert scheduler_stats.num_draft_tokens > scheduler_stats.num_accepted_tokens
    if kv_blocks:
        assert scheduler_stats.num_preemptions > 0
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    engine.kv_cache.check_invariants()


def test_sampling_with_speculation_runs_and_frees(prompts):
    llm = LLM(speculative_config=SPEC, kv_cache_memory=0.25)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=NEW_TOKENS)
    first = llm.generate(prompt_token_ids=prompts[-2:], sampling_params=params, use_tqdm=False)
    again = llm.generate(prompt_token_ids=prompts[-2:], sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]  # seeded
    assert all(len(o.outputs[0].token_ids) > 0 for o in first)
    assert llm.llm_engine.kv_cache.num_free_blocks == llm.llm_engine.kv_cache.num_blocks


def test_acceptance_rule_gives_the_target_distribution(default_llm, hf_default_model, chat_prompt_ids):
    """Draw many verified tokens for one position with a fixed seed: their counts must fit the
    model's own next-token distribution (chi-square), whichever draft was proposed."""
    with torch.no_grad():
        logits = hf_default_model(torch.tensor([chat_prompt_ids[1]])).logits[0, -1]
    # The model's 64 likeliest tokens, renormalised and flattened a little (more tokens with mass):
    # a real distribution over a small vocabulary, so that 40,000 verifications take seconds.
    probs = torch.softmax(logits.topk(64).values / 1.5, dim=-1)
    top = probs.topk(6).indices.tolist()
    generator = torch.Generator().manual_seed(1234)
    trials = 20000
    for draft in (top[0], top[3]):  # a likely draft and an unlikely one
        counts: dict[int, int] = {}
        for _ in range(trials):
            token = verify_drafts([draft], torch.tensor([0, 0]), probs.expand(2, -1), generator)[0]
            counts[token] = counts.get(token, 0) + 1
        observed = np.array([counts.get(t, 0) for t in top] + [trials - sum(counts.get(t, 0) for t in top)])
        expected_p = np.array([float(probs[t]) for t in top] + [1 - float(probs[top].sum())])
        expected_p /= expected_p.sum()  # float32's last bits: chisquare wants the totals to agree
        result = stats.chisquare(observed, expected_p * trials)
        assert result.pvalue > 0.001, (draft, observed, expected_p * trials)
