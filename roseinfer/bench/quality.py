"""`roseinfer bench quality`: how far each dtype and quantization moves the model's next-token
distributions from float32's, measured the way llama.cpp's `llama-perplexity --kl-divergence` does.

The corpus (by default the shipped public-domain text, data/sotu.txt) is tokenized as a whole and
cut into chunks of `--ctx-size` tokens; each chunk runs from an empty cache through the engine's
own model forward (chunk_logits.py) and only its second half is scored (corpus.py). For each mode
(`dtype+quantization`): perplexity, mean and 99th-percentile KL divergence from float32 with no
quantization, and the share of positions where both rank the same token first. All models are
loaded at once and every chunk goes through all of them before the next, so only one chunk's
distributions are ever held.

With `--llama-perplexity` (and `--llama-f32-gguf`, an F32 GGUF of the same weights) llama.cpp's
figures for its quantized file on the same text go beside ours, after a check that llama.cpp
evaluated the same token ids; a last row compares our float32 with llama.cpp's F32 directly.

`--files` scores quantized GGUF files of the same weights in their own types (`--quantization
auto`) against `--model` in float32 (its F32 GGUF), each beside llama.cpp's figures on that file:

    roseinfer bench quality --model smollm2-f32.gguf --methods --files smollm2-Q4_K_M.gguf ... \
        --llama-perplexity .../llama-perplexity --llama-f32-gguf smollm2-f32.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from roseinfer.bench.chunk_logits import ChunkLogits, Mode
from roseinfer.bench.corpus import DEFAULT_CORPUS, ScoredSpan, context_chunks
from roseinfer.bench.llama_perplexity import LlamaBaseFile, LlamaFigures, run_llama_perplexity
from roseinfer.bench.next_token_scores import QualitySummary, ScoreAccumulator, log_probs
from roseinfer.layers.linear import QUANTIZATION_METHODS
from roseinfer.models.default_model import default_model_path

REFERENCE = Mode("float32", "none")
FILE_MODE = Mode("float32", "auto")  # a quantized file in its own types
DEFAULT_MODES = ["bfloat16+none", "float32+int8", "float32+int4"]
LLAMA_FLOOR = -16.0  # llama.cpp leaves reference log-probabilities at or below this out of its KL


@dataclass
class _Entry:
    """One row of the table: a loaded mode, its scores and the time its forwards took."""

    label: str
    model: ChunkLogits
    tokens_per_step: int | None = None  # None: the whole chunk in one forward
    scores: ScoreAccumulator = field(default_factory=ScoreAccumulator)
    seconds: float = 0.0

    def score(self, chunk: list[int], rows: slice, targets: torch.Tensor, reference: torch.Tensor | None) -> torch.Tensor:
        clock = time.perf_counter()
        candidate = log_probs(self.model(chunk, rows, self.tokens_per_step))
        self.seconds += time.perf_counter() - clock
        self.scores.add(candidate, targets, reference)
        return candidate


def _check_llama_tokens(base: LlamaBaseFile, tokens: list[int], n_ctx: int) -> str:
    if base.n_ctx != n_ctx:
        raise RuntimeError(f"llama-perplexity used a context of {base.n_ctx}, not {n_ctx}")
    ours = np.asarray(tokens[: base.tokens.size], dtype=np.int32)
    if ours.size != base.tokens.size:
        raise RuntimeError(f"llama.cpp evaluated {base.tokens.size} tokens, the text has {len(tokens)} for us")
    differing = int((ours != base.tokens).sum())
    if differing:
        first = int(np.flatnonzero(ours != base.tokens)[0])
        return (f"WARNING: llama.cpp's tokens differ from ours at {differing} of {ours.size} positions "
                f"(first at {first}): its perplexity is not comparable with ours")
    return f"llama.cpp evaluated the same {ours.size} token ids as we did"


def _llama_quantized_gguf(args: argparse.Namespace) -> Path:
    if args.llama_gguf is not None:
        return args.llama_gguf
    if args.model is None:
        return default_model_path()
    if Path(args.model).suffix.lower() == ".gguf":
        return Path(args.model)
    raise SystemExit("--llama-gguf is needed when --model is not a GGUF file")


def _row(name: str, summary: QualitySummary | None = None, seconds: float | None = None, **given) -> dict:
    row = {"mode": name, **(asdict(summary) if summary else {}), **given}
    if seconds is not None:
        row["forward_seconds"] = seconds
    return row


def _print_table(rows: list[dict], header: str) -> None:
    def cell(row: dict, key: str, form: str, scale: float = 1.0) -> str:
        value = row.get(key)
        return "" if value is None else format(value * scale, form)

    width = max(len(row["mode"]) for row in rows)
    print(f"\n{header}")
    print(f"{'mode':<{width}} {'PPL':>9} {'mean KLD':>18} {'99% KLD':>9} {'same top %':>10} {'forward s':>9}")
    for row in rows:
        mean = cell(row, "mean_kld", ".5f")
        if mean and row.get("mean_kld_stderr") is not None:
            mean += f" ± {row['mean_kld_stderr']:.5f}"
        print(f"{row['mode']:<{width}} {cell(row, 'perplexity', '.4f'):>9} {mean:>18} {cell(row, 'kld_p99', '.5f'):>9} "
              f"{cell(row, 'same_top', '.2f', 100.0):>10} {cell(row, 'forward_seconds', '.1f'):>9}")


def run_quality(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    modes = [Mode.parse(text) for text in args.methods]
    llama_wanted = args.llama_perplexity is not None
    if llama_wanted != (args.llama_f32_gguf is not None):
        raise SystemExit("--llama-perplexity and --llama-f32-gguf go together")
    if not args.corpus.is_file():
        raise SystemExit(f"corpus {args.corpus} not found")

    n_ctx = args.ctx_size
    span = ScoredSpan(n_ctx)
    reference, tokenizer = ChunkLogits.load(args.model, args.tokenizer, args.device, REFERENCE, n_ctx)
    corpus = args.corpus.read_text(encoding="utf-8")
    # As llama-perplexity does: the whole text at once, a BOS only where the model asks for one.
    tokens = tokenizer.encode(corpus, add_special_tokens=True)
    chunks = context_chunks(tokens, n_ctx, args.chunks)
    notes = [f"{args.corpus.name}: {len(tokens)} tokens, {len(chunks)} chunks of {n_ctx}, "
             f"{len(chunks) * span.num_scored} scored positions"]

    llama: LlamaFigures | None = None
    base: LlamaBaseFile | None = None
    scratch = tempfile.TemporaryDirectory(prefix="roseinfer-quality-")
    if llama_wanted and (modes or not args.files):
        llama = run_llama_perplexity(
            args.llama_perplexity, args.llama_f32_gguf, _llama_quantized_gguf(args), args.corpus, n_ctx,
            args.chunks, args.llama_threads, Path(scratch.name) / "f32-base.dat",
        )
    if llama_wanted:
        if llama is None:  # only --files: the base run alone, for the token check
            run_llama_perplexity(args.llama_perplexity, args.llama_f32_gguf, args.llama_f32_gguf, args.corpus, n_ctx,
                                 args.chunks, args.llama_threads, Path(scratch.name) / "f32-base.dat")
        base = LlamaBaseFile(Path(scratch.name) / "f32-base.dat")
        notes.append(_check_llama_tokens(base, tokens, n_ctx))
        if llama is not None:
            notes += ["llama.cpp commands:", *("  " + " ".join(command) for command in llama.commands)]

    # One entry per row: a mode given twice (or float32+none itself) is loaded and scored again.
    entries = [_Entry(f"{REFERENCE} (reference)", reference)] + [
        _Entry(str(mode), ChunkLogits.load(args.model, args.tokenizer, args.device, mode, n_ctx)[0]) for mode in modes
    ] + [
        _Entry(f"{path.name} (own types)", ChunkLogits.load(str(path), args.tokenizer, args.device, FILE_MODE, n_ctx)[0])
        for path in args.files
    ]
    file_figures = []
    if llama_wanted:
        for path in args.files:  # llama.cpp on each of the same files, against the same base
            figures = run_llama_perplexity(args.llama_perplexity, args.llama_f32_gguf, path, args.corpus, n_ctx,
                                           args.chunks, args.llama_threads, Path(scratch.name) / "f32-base.dat")
            file_figures.append((path, figures))
            notes.append("  " + " ".join(figures.commands[-1]))
    if args.decode_rows:  # the same models again, fed as decode steps of that many rows are
        entries += [_Entry(f"{entry.label}, {args.decode_rows} rows a step", entry.model, args.decode_rows)
                    for entry in entries[1:]]
    for entry in entries:  # first calls build kernels: keep them out of the times
        entry.model(chunks[0][:32], slice(0, 1))
    cross_check = ScoreAccumulator()
    for index, chunk in enumerate(chunks):
        targets = torch.tensor(chunk[span.target_positions], device=reference.device)
        ref = entries[0].score(chunk, span.logit_rows, targets, None)
        if base is not None:
            cross_check.add(ref.cpu(), targets.cpu(), base.log_probs(index), reference_floor=LLAMA_FLOOR)
        for entry in entries[1:]:
            entry.score(chunk, span.logit_rows, targets, ref)
        print(f"chunk {index + 1}/{len(chunks)}", file=sys.stderr, flush=True)
    scratch.cleanup()

    rows = [_row(entry.label, entry.scores.summary(), entry.seconds) for entry in entries]
    for path, figures in file_figures:
        rows.append(_row(f"llama.cpp {path.name}", perplexity=figures.perplexity, mean_kld=figures.mean_kld,
                         mean_kld_stderr=figures.mean_kld_stderr, kld_p99=figures.kld_p99, same_top=figures.same_top))
    some_figures = llama or (file_figures[0][1] if file_figures else None)
    if some_figures is not None:
        rows.append(_row("llama.cpp F32 (its reference)", perplexity=some_figures.base_perplexity))
    if llama is not None:
        rows.append(_row(f"llama.cpp {_llama_quantized_gguf(args).name}", perplexity=llama.perplexity,
                         mean_kld=llama.mean_kld,
                         mean_kld_stderr=llama.mean_kld_stderr, kld_p99=llama.kld_p99, same_top=llama.same_top))
    if base is not None:
        cross = cross_check.summary()
        rows.append(_row("float32 vs llama.cpp F32", mean_kld=cross.mean_kld, mean_kld_stderr=cross.mean_kld_stderr,
                         kld_p99=cross.kld_p99, same_top=cross.same_top))
    notes.append(f"wall time {time.perf_counter() - started:.1f} s")
    _print_table(rows, "next-token distributions against float32 (KL divergence in nats)")
    print("\n".join(notes))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "notes": notes}, indent=2))
    return 0


def _mode(text: str) -> str:
    try:
        mode = Mode.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    dtypes = ("float32", "bfloat16", "float16")
    if mode.dtype not in dtypes or mode.quantization not in QUANTIZATION_METHODS or (
        mode.kv_cache_dtype not in ("auto", "q8_0", *dtypes)
    ):
        raise argparse.ArgumentTypeError(
            f"{text!r}: the dtype must be float32, bfloat16 or float16 (the KV cache dtype also q8_0) and the quantization "
            f"one of {', '.join(QUANTIZATION_METHODS)}"
        )
    return text


def _at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from exc
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser(
        "quality", help="perplexity and KL divergence from float32 of each dtype and quantization"
    )
    parser.add_argument("--model", "--checkpoint-path", dest="model", default=None,
                        help="GGUF file or Hugging Face model directory (default: the default model)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (bare checkpoints)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda (default: auto)")
    parser.add_argument("--files", nargs="+", type=Path, default=[], metavar="GGUF",
                        help="quantized GGUF files of --model's weights, scored in their own types")
    parser.add_argument("--methods", nargs="*", type=_mode, default=DEFAULT_MODES, metavar="DTYPE+QUANTIZATION[+KV_DTYPE]",
                        help="modes scored against float32+none (default: %(default)s)")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS,
                        help="UTF-8 text to score (default: the shipped State of the Union addresses)")
    parser.add_argument("--ctx-size", type=_at_least(4), default=512, help="tokens per chunk (llama-perplexity's -c)")
    parser.add_argument("--chunks", type=_at_least(1), default=None, help="score only the first N chunks")
    parser.add_argument("--decode-rows", type=_at_least(0), default=16, metavar="N",
                        help="also score each mode fed N tokens a step, so that every layer runs the kernels "
                             "of a decode step of N requests (0: only whole-chunk prefills; default 16)")
    parser.add_argument("--llama-perplexity", type=Path, default=None, metavar="PATH",
                        help="llama.cpp's llama-perplexity binary: put its figures beside ours")
    parser.add_argument("--llama-f32-gguf", type=Path, default=None, metavar="PATH",
                        help="F32 GGUF of the same weights, llama.cpp's reference")
    parser.add_argument("--llama-gguf", type=Path, default=None, metavar="PATH",
                        help="the quantized GGUF llama.cpp scores (default: --model, or the default model)")
    parser.add_argument("--llama-threads", type=_at_least(1), default=os.cpu_count() or 1, help="llama.cpp's -t")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.set_defaults(handler=run_quality)
