"""`roseinfer bench quality`: its perplexity and KL divergence against independent computations
(transformers' logits, PyTorch's kl_div, llama.cpp's percentile rule), its chunking, its reader of
llama.cpp's base file, and the command end to end on a tiny model."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support import CORPUS, tiny_hf_model

from roseinfer.bench.chunk_logits import ChunkLogits
from roseinfer.bench.corpus import DEFAULT_CORPUS, ScoredSpan, context_chunks
from roseinfer.bench.llama_perplexity import LlamaBaseFile
from roseinfer.bench.next_token_scores import ScoreAccumulator, kl_divergence, log_probs
from roseinfer.cli import main


def test_shipped_corpus_is_large_enough(smollm_tokenizer):
    tokens = smollm_tokenizer.encode(DEFAULT_CORPUS.read_text(encoding="utf-8"), add_special_tokens=True)
    assert len(tokens) >= 20_000
    assert (DEFAULT_CORPUS.parent / "README.md").is_file()


def test_chunks_and_scored_span():
    tokens = list(range(1030))
    chunks = context_chunks(tokens, 512)
    assert chunks == [tokens[:512], tokens[512:1024]]  # the partial remainder is dropped
    assert context_chunks(tokens, 512, max_chunks=1) == [tokens[:512]]
    span = ScoredSpan(512)
    assert (span.first, span.num_scored) == (256, 255)  # llama-perplexity: n_ctx - 1 - n_ctx / 2
    assert chunks[0][span.target_positions] == list(range(257, 512))
    with pytest.raises(ValueError, match="fewer than one chunk"):
        context_chunks(tokens[:100], 512)


def test_kl_divergence_matches_torch_and_is_zero_against_itself():
    generator = torch.Generator().manual_seed(0)
    reference = log_probs(torch.randn(6, 50, generator=generator) * 3)
    candidate = log_probs(torch.randn(6, 50, generator=generator) * 3)
    expected = F.kl_div(candidate.double(), reference.double(), log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(kl_divergence(reference, candidate), expected)
    assert torch.equal(kl_divergence(reference, reference), torch.zeros(6, dtype=torch.float64))

    scores = ScoreAccumulator()
    targets = torch.tensor([0, 1, 2, 3, 4, 5])
    scores.add(reference, targets, reference)
    summary = scores.summary()
    assert summary.mean_kld == 0.0 and summary.kld_p99 == 0.0 and summary.same_top == 1.0
    assert summary.perplexity == pytest.approx(math.exp(-reference[torch.arange(6), targets].double().mean().item()))


def test_kld_percentile_is_llama_cpps_linear_interpolation():
    generator = torch.Generator().manual_seed(1)
    reference = log_probs(torch.randn(301, 20, generator=generator))
    candidate = log_probs(torch.randn(301, 20, generator=generator))
    scores = ScoreAccumulator()
    scores.add(candidate, torch.zeros(301, dtype=torch.long), reference)
    values = sorted(kl_divergence(reference, candidate).tolist())
    position = 0.99 * (len(values) - 1)
    low = int(position)
    expected = (1 - (position - low)) * values[low] + (position - low) * values[low + 1]
    assert scores.summary().kld_p99 == pytest.approx(expected)


def test_perplexity_of_the_default_model_matches_transformers(hf_default_model, default_engine):
    """One chunk of the shipped corpus through the engine's forward, against transformers' own
    loss over the same scored positions."""
    n_ctx = 128
    text = DEFAULT_CORPUS.read_text(encoding="utf-8")
    chunk = context_chunks(default_engine.tokenizer.encode(text, add_special_tokens=True), n_ctx, max_chunks=1)[0]
    span = ScoredSpan(n_ctx)
    ours = ScoreAccumulator()
    assert default_engine.dtype == torch.float32 and default_engine.config.quantization == "none"  # exact
    model = ChunkLogits(default_engine.model, default_engine.model_config, default_engine.device, torch.float32, n_ctx)
    ours.add(log_probs(model(chunk, span.logit_rows)), torch.tensor(chunk[span.target_positions]))

    with torch.no_grad():
        logits = hf_default_model(torch.tensor([chunk])).logits[0, span.logit_rows]
    nll = F.cross_entropy(logits.double(), torch.tensor(chunk[span.target_positions]))
    assert ours.summary().tokens == span.num_scored
    assert ours.summary().perplexity == pytest.approx(math.exp(nll.item()), rel=1e-4)


def test_reads_llama_cpp_base_file(tmp_path):
    """A base file laid out as llama-perplexity writes it: '_logits_', n_ctx (u32), n_vocab and
    n_chunk (i32), the tokens (i32), then per scored position a float32 scale and minimum
    log-probability followed by uint16 codes, padded to an even count."""
    n_ctx, n_vocab, n_chunk = 8, 5, 2
    span = ScoredSpan(n_ctx)
    tokens = np.arange(n_ctx * n_chunk, dtype=np.int32)
    expected = log_probs(torch.randn(n_chunk * span.num_scored, n_vocab, generator=torch.Generator().manual_seed(2)))
    row_len = 2 * ((n_vocab + 1) // 2) + 4
    rows = np.zeros((expected.shape[0], row_len), dtype=np.uint16)
    for i, values in enumerate(expected.numpy()):
        minimum, scale = float(values.min()), float(values.max() - values.min()) / 65535
        rows[i, :4] = np.array([scale, minimum], dtype=np.float32).view(np.uint16)
        rows[i, 4 : 4 + n_vocab] = np.round((values - minimum) / scale)
    path = tmp_path / "base.dat"
    path.write_bytes(b"_logits_" + np.uint32(n_ctx).tobytes() + np.array([n_vocab, n_chunk], np.int32).tobytes()
                     + tokens.tobytes() + rows.tobytes())

    base = LlamaBaseFile(path)
    assert (base.n_ctx, base.n_vocab, base.n_chunk) == (n_ctx, n_vocab, n_chunk)
    assert np.array_equal(base.tokens, tokens)
    torch.testing.assert_close(base.log_probs(1), expected[span.num_scored :], atol=1e-3, rtol=0)


def test_bench_quality_command_on_a_tiny_model(tmp_path, capsys):
    tiny_hf_model("llama", tmp_path / "tiny")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(CORPUS), encoding="utf-8")
    report = tmp_path / "quality.json"
    assert main(["bench", "quality", "--model", str(tmp_path / "tiny"), "--corpus", str(corpus),
                 "--ctx-size", "64", "--chunks", "3", "--methods", "float32+none", "bfloat16+none",
                 "float32+int4", "--json", str(report)]) == 0
    rows = {row["mode"]: row for row in json.loads(report.read_text())["rows"]}
    assert list(rows) == ["float32+none (reference)", "float32+none", "bfloat16+none", "float32+int4",
                          "float32+none, 16 rows a step", "bfloat16+none, 16 rows a step",
                          "float32+int4, 16 rows a step"]
    # fed 16 tokens a step, the float32 model computes the same distributions as in one forward
    assert rows["float32+none, 16 rows a step"]["mean_kld"] < 1e-6
    reference = rows["float32+none (reference)"]
    assert reference["tokens"] == 3 * 31 and reference["mean_kld"] is None
    assert rows["float32+none"]["mean_kld"] == 0.0  # the same kernels give the same distributions
    assert rows["float32+none"]["perplexity"] == reference["perplexity"]
    for mode in ("bfloat16+none", "float32+int4"):
        assert 0.0 < rows[mode]["mean_kld"] < 0.1
    assert "float32+int4" in capsys.readouterr().out


def test_bench_quality_rejects_bad_modes():
    with pytest.raises(SystemExit):
        main(["bench", "quality", "--methods", "float32"])
    with pytest.raises(SystemExit):
        main(["bench", "quality", "--methods", "float32+int3"])
