"""End-to-end greedy generation on the default model against transformers, batch invariance,
preemption under a tiny KV pool, and seeded sampling that ignores the batch around it."""

import pytest
import torch

from roseinfer import LLM, SamplingParams

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def reference_outputs(hf_default_model, chat_prompt_ids) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, generated alone (no padding)."""
    outputs = []
    with torch.no_grad():
        for ids in chat_prompt_ids:
            out = hf_default_model.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=2,
                pad_token_id=2,
            )
            outputs.append(out[0, len(ids):].tolist())
    return outputs


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_batched_greedy_equals_transformers(default_llm, chat_prompt_ids, reference_outputs):
    assert len({len(p) for p in chat_prompt_ids}) == len(chat_prompt_ids), "want different lengths"
    outputs = default_llm.generate(prompt_token_ids=chat_prompt_ids, sampling_params=GREEDY, use_tqdm=False)
    assert token_ids(outputs) == reference_outputs
    assert sum(len(r) for r in reference_outputs) > 4 * NEW_TOKENS  # not all stopped at once
    for output, ids in zip(outputs, chat_prompt_ids, strict=True):
        assert output.prompt_token_ids == ids
        completion = output.outputs[0]
        assert completion.finish_reason == ("stop" if completion.token_ids[-1] == 2 else "length")
        assert completion.text == default_llm.get_tokenizer().decode(completion.token_ids)


def test_batch_invariance(default_llm, chat_prompt_ids, reference_outputs):
    alone = [
        default_llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY, use_tqdm=False)[0]
        for ids in chat_prompt_ids
    ]
    assert token_ids(alone) == reference_outputs


def test_preemption_gives_the_same_output_and_frees_every_block(chat_prompt_ids, reference_outputs):
    llm = LLM(num_kv_blocks=14, max_num_seqs=8, quantization="none")
    outputs = llm.generate(prompt_token_ids=chat_prompt_ids, sampling_params=GREEDY, use_tqdm=False)
    engine = llm.engine
    assert engine.scheduler.stats.num_preemptions > 0, "the pool was meant to be too small"
    assert token_ids(outputs) == reference_outputs
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    engine.kv_cache.check_invariants()


def test_seeded_sampling_is_reproducible_whatever_the_batch(default_llm, chat_prompt_ids):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    noisy = SamplingParams(temperature=1.0, max_tokens=24)
    alone = default_llm.generate(prompt_token_ids=[chat_prompt_ids[2]], sampling_params=seeded, use_tqdm=False)
    crowd = default_llm.generate(
        prompt_token_ids=[chat_prompt_ids[0], chat_prompt_ids[2], chat_prompt_ids[5]],
        sampling_params=[noisy, seeded, noisy],
        use_tqdm=False,
    )
    assert crowd[1].outputs[0].token_ids == alone[0].outputs[0].token_ids
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=24, ignore_eos=True)
    different = default_llm.generate(prompt_token_ids=[chat_prompt_ids[2]], sampling_params=other_seed, use_tqdm=False)
    assert different[0].outputs[0].token_ids != alone[0].outputs[0].token_ids


def test_n_sequences_with_a_seed(default_llm, chat_prompt_ids):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    first = default_llm.generate(prompt_token_ids=[chat_prompt_ids[1]], sampling_params=params, use_tqdm=False)[0]
    again = default_llm.generate(prompt_token_ids=[chat_prompt_ids[1]], sampling_params=params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
