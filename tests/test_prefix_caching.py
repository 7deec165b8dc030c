"""Prefix caching and n > 1 block sharing on the default model: outputs identical with the cache
on and off, and regression tests for the bugs such caches are known for (a full-prompt hit, a
preempted request holding cached blocks, an evicted block found through a stale key, two requests
computing the same new prefix in one step)."""

import pytest
from support import EXACT

from roseinfer import LLM, SamplingParams

SYSTEM = (
    "You are a meticulous assistant for a public library. Answer questions about opening hours, "
    "loans, renewals, fines, events for children and adults, study rooms, printing, and the "
    "digital collection. Keep answers short and friendly, and say when you do not know."
)
QUESTIONS = ["When do you open on Sundays?", "How do I renew a book?", "Can I print in colour?",
             "Are there events for toddlers?", "How much is a late fine?", "Do you lend e-books?"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def chat_ids(llm: LLM, question: str) -> list[int]:
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    )
    return tokenizer.encode(text, add_special_tokens=False)


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_blocks_free(llm: LLM) -> None:
    kv = llm.llm_engine.kv_cache
    kv.check_invariants()
    assert not any(group.block_tables for group in kv.groups) and kv.num_free_blocks == kv.num_blocks


@pytest.fixture(scope="module")
def uncached():
    return LLM(**EXACT, num_kv_blocks=256, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def prompts(uncached) -> list[list[int]]:
    return [chat_ids(uncached, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(uncached, prompts) -> list[list[int]]:
    return generate(uncached, prompts)


def test_shared_system_prompt_is_computed_once_and_outputs_are_identical(prompts, reference):
    llm = LLM(**EXACT, num_kv_blocks=256)
    kv, stats = llm.llm_engine.kv_cache, llm.llm_engine.scheduler.stats
    assert generate(llm, prompts[:1]) == reference[:1]
    computed_alone = stats.num_scheduled_tokens
    assert generate(llm, prompts[1:]) == reference[1:]
    shared_blocks = len(prompts[0]) // 2 // kv.block_size  # the system prompt is most of it
    assert kv.prefix_stats.hits >= (len(prompts) - 1) * shared_blocks * kv.block_size
    # Each later prompt computed only its own tail (and the outputs), not the system prompt.
    later = stats.num_scheduled_tokens - computed_alone
    assert later < sum(len(p) for p in prompts[1:]) - (len(prompts) - 1) * shared_blocks * kv.block_size + 12 * 5
    assert_all_blocks_free(llm)


def test_a_prompt_that_is_all_cached_still_computes_its_last_token(prompts, reference):
    llm = LLM(**EXACT, num_kv_blocks=256)
    block_size = llm.llm_engine.kv_cache.block_size
    # A prompt of whole blocks: every block is cached after the first run.
    whole = prompts[0][: len(prompts[0]) // block_size * block_size]
    first = generate(llm, [whole])
    hits_before = llm.llm_engine.kv_cache.prefix_stats.hits
    assert generate(llm, [whole]) == first
    # All blocks but the last are reused; the last is recomputed for the last token's logits.
    assert llm.llm_engine.kv_cache.prefix_stats.hits - hits_before == len(whole) - block_size
    assert_all_blocks_free(llm)


def test_preempted_requests_holding_cached_blocks_give_the_same_output(prompts, reference):
    # 6 prompts of ~70 tokens (5 blocks each) + outputs in 28 blocks: preemption is certain.
    llm = LLM(**EXACT, num_kv_blocks=28, max_num_seqs=6)
    assert generate(llm, prompts) == reference
    assert llm.llm_engine.scheduler.stats.num_preemptions > 0
    assert llm.llm_engine.kv_cache.prefix_stats.hits > 0
    assert_all_blocks_free(llm)


def test_evicted_blocks_are_never_found_through_stale_keys(prompts, reference):
    llm = LLM(**EXACT, num_kv_blocks=12, max_num_seqs=1)  # room for one request: every run evicts
    for _ in range(2):
        for prompt, expected in zip(prompts, reference, strict=True):
            assert generate(llm, [prompt]) == [expected]
    assert llm.llm_engine.kv_cache.prefix_stats.hits > 0
    assert_all_blocks_free(llm)


def test_two_requests_with_the_same_new_prefix_in_one_step(prompts, reference):
    llm = LLM(**EXACT, num_kv_blocks=256)
    assert generate(llm, [prompts[0], prompts[0], prompts[1]]) == [reference[0], reference[0], reference[1]]
    assert llm.llm_engine.scheduler.stats.max_batch_requests == 3  # all three prefilled together
    # Their duplicate blocks were not cached twice; a later request finds one copy.
    hits_before = llm.llm_engine.kv_cache.prefix_stats.hits
    assert generate(llm, [prompts[0]]) == [reference[0]]
    assert llm.llm_engine.kv_cache.prefix_stats.hits > hits_before
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_n_sequences_share_the_prompt_blocks(prompts, prefix_caching):
    llm = LLM(**EXACT, num_kv_blocks=256, enable_prefix_caching=prefix_caching)
    params = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=8, ignore_eos=True)
    stats = llm.llm_engine.scheduler.stats
    (together,) = llm.generate(prompt_token_ids=[prompts[2]], sampling_params=params, use_tqdm=False)
    # One prompt computation, plus the last prompt token again for each of the two others.
    assert stats.num_scheduled_tokens == len(prompts[2]) + 2 + 3 * 7
    # Each sequence equals a request of its own with its own seed (seed + index).
    llm_alone = LLM(**EXACT, num_kv_blocks=256, enable_prefix_caching=False)
    for index, completion in enumerate(together.outputs):
        alone = SamplingParams(temperature=0.8, seed=11 + index, max_tokens=8, ignore_eos=True)
        assert completion.token_ids == generate(llm_alone, [prompts[2]], alone)[0]
    assert_all_blocks_free(llm)
