"""`roseinfer bench single`: one stream's decode speed against llama.cpp's `llama-bench`, in one run.

llama.cpp's figure is `llama-bench -p 0 -n N -t <threads>` (tg N: N tokens generated from an
empty context, prompt time excluded) on the GGUF file itself. Ours is the same count of new tokens
for a one-token prompt (greedy, EOS ignored), timed from the first decoded token to the last so
that prompt time is excluded too, averaged over 5 requests as llama-bench averages its 5
repetitions. Each configuration runs in a fresh process,
the peer and our configurations alternate, and the whole round is repeated (--repeats): the load
average is printed beside each figure because these machines are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CONFIGURATIONS = {  # name -> LLM(...) keywords
    "auto": {},  # the file's own types (the default)
    "float32": {"dtype": "float32", "quantization": "none"},
    "bfloat16": {"dtype": "bfloat16", "quantization": "none"},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
}


def load_one_stream(model: str | None, settings: dict, threads: int):
    """An LLM for one-stream decode, warmed up by one request."""
    import torch

    torch.set_num_threads(threads)
    from roseinfer import LLM, SamplingParams

    llm = LLM(model, kv_cache_memory=0.25, **settings)
    warm = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm.generate(prompt_token_ids=[[1]], sampling_params=warm, use_tqdm=False)
    return llm


def one_stream_rate(llm, tokens: int, request_id: str) -> float:
    """Decode tokens/s of one request of `tokens` tokens after a one-token prompt, timed from its
    first token (the prompt's: not timed), as llama-bench's tg times only generated tokens."""
    from roseinfer import SamplingParams

    engine = llm.llm_engine
    engine.add_request(request_id, [1], SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True))
    started = None
    produced = latest = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            count = len(output.outputs[0].token_ids)
            if started is None and count:
                started, produced = time.perf_counter(), count
            else:
                latest = count
    return (latest - produced) / (time.perf_counter() - started)


def mean_rate(llm, tokens: int, repetitions: int, tag: str) -> float:
    """The mean of `repetitions` requests' one_stream_rate (llama-bench's avg_ts is such a mean)."""
    rates = [one_stream_rate(llm, tokens, f"{tag}-{repetition}") for repetition in range(repetitions)]
    return sum(rates) / len(rates)


def measure_ours(model: str | None, settings: dict, tokens: int, threads: int, repetitions: int = 5) -> float:
    """Tokens per second of one stream's decode after a warm-up request: the mean over
    `repetitions` requests of each one's rate, the statistic llama-bench prints (avg_ts over its
    default 5 repetitions), so that both figures average the same number of runs."""
    return mean_rate(load_one_stream(model, settings, threads), tokens, repetitions, "single")


def answer_rates(model: str, tokens: int, threads: int, repetitions: int) -> None:
    """A measuring process kept loaded between rounds: loads the model once, then for each line on
    stdin prints (one JSON number a line) the mean rate of `repetitions` requests; ends at EOF."""
    llm = load_one_stream(model, {}, threads)
    print("ready", flush=True)
    for index, _ in enumerate(sys.stdin):
        print(json.dumps(mean_rate(llm, tokens, repetitions, f"round-{index}")), flush=True)


def measure_llama_bench(binary: Path, model: Path, tokens: int, threads: int, prompt: int = 0,
                        repetitions: int = 5) -> float:
    """llama-bench's avg_ts over `repetitions` runs: tg `tokens` (prompt 0), or pp `prompt` with tokens 0."""
    result = subprocess.run([str(binary), "-m", str(model), "-p", str(prompt), "-n", str(tokens), "-t", str(threads),
                             "-r", str(repetitions), "-o", "json"], capture_output=True, text=True, check=True)
    rows = json.loads(result.stdout)
    return float(rows[0]["avg_ts"])


def _in_fresh_process(name: str, args: argparse.Namespace) -> float:
    code = ("import json, sys; from roseinfer.bench.single_stream import measure_ours, CONFIGURATIONS; "
            f"print(json.dumps(measure_ours({args.model!r}, CONFIGURATIONS[{name!r}], {args.tokens}, {args.threads})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"measuring {name} failed:\n{result.stderr[-3000:]}")
    return float(result.stdout.strip().splitlines()[-1])


def run_single(args: argparse.Namespace) -> int:
    from roseinfer.models.default_model import default_model_path

    gguf = Path(args.model) if args.model else default_model_path()
    names = args.configurations
    unknown = sorted(set(names) - set(CONFIGURATIONS))
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; known: {sorted(CONFIGURATIONS)}")
    figures: dict[str, list[tuple[float, float]]] = {}
    for round_index in range(args.repeats):
        if args.llama_bench:
            value = measure_llama_bench(args.llama_bench, gguf, args.tokens, args.threads)
            figures.setdefault("llama-bench", []).append((value, os.getloadavg()[0]))
        for name in names:
            value = _in_fresh_process(name, args)
            figures.setdefault(name, []).append((value, os.getloadavg()[0]))
        print(f"round {round_index + 1}: " + ", ".join(f"{k} {v[-1][0]:.1f}" for k, v in figures.items()), flush=True)
    peer = figures.get("llama-bench")
    print(f"\none stream, tg{args.tokens}, {args.threads} threads, {gguf.name}; each round: "
          "llama-bench then ours, each in a fresh process")
    print(f"{'system':<14}" + "".join(f"{'round ' + str(i + 1):>18}" for i in range(args.repeats)) + f"{'vs llama-bench':>16}")
    for name, values in figures.items():
        cells = "".join(f"{v:>8.1f} (load {load:.2f})" for v, load in values)
        ratio = ""
        if peer and name != "llama-bench":
            ratios = [v / p for (v, _), (p, _) in zip(values, peer, strict=True)]
            ratio = f"{min(ratios):.2f}-{max(ratios):.2f}x"
        print(f"{name:<14}{cells}{ratio:>16}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("single", help="one stream's decode tokens/s against llama.cpp's llama-bench")
    parser.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--llama-bench", type=Path, default=None, help="a llama-bench binary (peer; skipped if not given)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--configurations", nargs="+", default=list(CONFIGURATIONS), metavar="NAME",
                        help=f"ours to measure (default all: {', '.join(CONFIGURATIONS)})")
    parser.add_argument("--json", type=Path, default=None)
    parser.set_defaults(handler=run_single)
