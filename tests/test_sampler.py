"""The vectorised sampler against references: transformers' logits processors for top-k, top-p,
min-p and repetition penalty; the OpenAI formula for presence/frequency penalties; softmax for the
distribution of samples; and per-request seeds that do not depend on the batch."""

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from roseinfer.worker.sampler import (
    Sampler,
    SamplingBatch,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
)

VOCAB = 50


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("k", [1, 5, 17, VOCAB, VOCAB + 1, 10**6])  # past the vocabulary: every token
def test_top_k_equals_transformers(k):
    logits = random_logits(4)
    expected = TopKLogitsWarper(top_k=k)(None, logits.clone())
    assert torch.equal(apply_top_k(logits, torch.full((4,), k)), expected)


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.99])
def test_top_p_equals_transformers(p):
    logits = random_logits(6, seed=1)
    expected = TopPLogitsWarper(top_p=p)(None, logits.clone())
    ours = apply_top_p(logits, torch.full((6,), p))
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5])
def test_min_p_equals_transformers(min_p):
    logits = random_logits(6, seed=2)
    expected = MinPLogitsWarper(min_p=min_p)(None, logits.clone())
    ours = apply_min_p(logits, torch.full((6,), min_p))
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))


def test_per_row_parameters_mix_in_one_batch():
    logits = random_logits(2, seed=3)
    ours = apply_top_k(logits, torch.tensor([2, VOCAB]))
    assert torch.isfinite(ours[0]).sum() == 2 and torch.isfinite(ours[1]).all()


def test_repetition_penalty_equals_transformers():
    logits = random_logits(2, seed=4)
    seen = torch.tensor([[3, 7, 7, 11], [0, 1, 2, 3]])
    expected = RepetitionPenaltyLogitsProcessor(penalty=1.3)(seen, logits.clone())
    mask = torch.zeros(2, VOCAB, dtype=torch.bool).scatter_(1, seen, True)
    batch = SamplingBatch(torch.ones(2), False, repetition_penalty=torch.full((2,), 1.3), seen_mask=mask)
    assert torch.allclose(apply_penalties(logits, batch), expected)


def test_presence_and_frequency_penalties_follow_openai():
    logits = random_logits(1, seed=5)
    counts = torch.zeros(1, VOCAB)
    counts[0, 4], counts[0, 9] = 3, 1
    batch = SamplingBatch(
        torch.ones(1), False, presence_penalty=torch.tensor([0.5]),
        frequency_penalty=torch.tensor([0.25]), output_counts=counts,
    )
    expected = logits.clone()
    expected[0, 4] -= 0.25 * 3 + 0.5
    expected[0, 9] -= 0.25 * 1 + 0.5
    assert torch.allclose(apply_penalties(logits, batch), expected)


def test_greedy_rows_take_the_argmax():
    logits = random_logits(8, seed=6)
    out = Sampler()(logits, SamplingBatch(torch.zeros(8), all_greedy=True))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    mixed = Sampler()(logits, SamplingBatch(torch.tensor([0.0, 1.0] * 4), all_greedy=False))
    assert torch.equal(mixed.token_ids[::2], logits.argmax(-1)[::2])


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_samples_follow_the_tempered_softmax(temperature):
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    rows = 40000
    out = Sampler()(logits.expand(rows, -1).clone(), SamplingBatch(torch.full((rows,), temperature), False))
    frequencies = torch.bincount(out.token_ids, minlength=5).float() / rows
    expected = torch.softmax(logits / temperature, -1)
    assert (frequencies - expected).abs().max() < 0.01


def test_top_k_samples_stay_in_the_top_k():
    torch.manual_seed(0)
    logits = random_logits(1, seed=7).expand(2000, -1).clone()
    batch = SamplingBatch(torch.ones(2000), False, top_k=torch.full((2000,), 3))
    out = Sampler()(logits, batch)
    assert set(out.token_ids.tolist()) <= set(logits[0].topk(3).indices.tolist())


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    logits = random_logits(1, seed=8)

    def sample(batch_rows: int, row: int) -> list[int]:
        generator = torch.Generator().manual_seed(1234)
        tokens = []
        for _ in range(20):
            batch_logits = random_logits(batch_rows, seed=len(tokens))
            batch_logits[row] = logits[0]
            batch = SamplingBatch(torch.ones(batch_rows), False, generators={row: generator})
            tokens.append(Sampler()(batch_logits, batch).token_ids[row].item())
        return tokens

    alone = sample(1, 0)
    assert sample(5, 3) == alone
    assert sample(9, 0) == alone
    assert len(set(alone)) > 1  # it really samples


def test_banned_tokens_are_never_sampled():
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 100.0  # would always win
    out = Sampler()(logits, SamplingBatch(torch.zeros(1), True, banned=[(0, [2])]))
    assert out.token_ids.item() != 2


def test_logprobs_are_raw_log_softmax():
    logits = random_logits(3, seed=9)
    out = Sampler()(logits, SamplingBatch(torch.zeros(3), True, max_logprobs=4))
    expected = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, expected.max(-1).values)
    assert torch.equal(out.top_ids, expected.topk(4).indices)
