"""`roseinfer bench gguf`: GGUF files as users bring them, roseinfer against llama.cpp in one run.

For each file, each measurement in a process of its own, never running beside another (our tg process
waits, idle, while llama-bench runs):
  * one stream, tg N: `llama-bench -p 0 -n N -r K` against N tokens generated after a one-token
    prompt (greedy, EOS ignored; timed from the first decoded token, the mean of K requests, as
    `bench single` does and as llama-bench averages its K repetitions; K = --runs-per-round, 5 as
    llama-bench's default). With --rounds R the pair is measured R times back to back, llama.cpp
    first in odd rounds and ours first in even ones, and the ratio printed is the median of the
    rounds' ratios: one-stream decode is bound by memory bandwidth, which on a shared VM drifts by
    10-30% from one minute to the next, so only figures taken side by side compare, and the closer
    the better. Ours is measured by one process that loads the file once and answers every round
    (llama-bench loads it each round: its load is not timed either), so many short rounds
    (`--rounds 10 --runs-per-round 1`) cost little more than a few long ones;
  * prompt processing, pp P: `llama-bench -p P -n 0` against the prefill of a P-token prompt (one
    request, one token out, timed to its first token; the median of --repeats);
  * served, S streams at once: `roseinfer serve` and `llama-server -np S -c S*C` through the same
    client (the shared `serve_client.py`, all S requests at once, EOS ignored), output tokens/s;
  * load: from process start to the first answer of /health, for both servers;
  * peak resident memory (VmHWM) of each server over its run.
Ratios are ours / llama.cpp's, from the same run. The table is printed and written as JSON.

    roseinfer bench gguf --files llama-1b-Q4_K_M.gguf --llama-bin /path/to/llama.cpp/build/bin \\
        --serve-client ../shared/bench/serve_client.py --prompts-file ../shared/bench/workload.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from roseinfer.bench.compare import _free_port, _roseinfer, _Server
from roseinfer.bench.single_stream import measure_llama_bench


def measure_prefill(model: str, prompt_tokens: int, threads: int, repeats: int) -> dict[str, float]:
    """Ours: the load time and the prefill tokens/s of a `prompt_tokens` prompt (median)."""
    import torch

    torch.set_num_threads(threads)
    from roseinfer import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model, kv_cache_memory=0.5, max_num_batched_tokens=prompt_tokens, max_model_len=2 * prompt_tokens)
    load = time.perf_counter() - started
    one = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate(prompt_token_ids=[[7] * 16], sampling_params=one, use_tqdm=False)  # warm-up
    rates = []
    for i in range(repeats):
        prompt = [(i * 31 + j) % 1000 + 10 for j in range(prompt_tokens)]  # no prefix-cache hits
        started = time.perf_counter()
        llm.generate(prompt_token_ids=[prompt], sampling_params=one, use_tqdm=False)
        rates.append(prompt_tokens / (time.perf_counter() - started))
    return {"load_s": round(load, 2), "pp": round(statistics.median(rates), 1)}


def _fresh(code: str) -> Any:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


class _OursKeptLoaded:
    """Our one-stream measurements from one process that loads the file once (single_stream.
    answer_rates), so that a round is only the timed requests and sits close to llama-bench's."""

    def __init__(self, model: str, args: argparse.Namespace) -> None:
        code = ("from roseinfer.bench.single_stream import answer_rates; "
                f"answer_rates({model!r}, {args.tokens}, {args.threads}, {args.runs_per_round})")
        self.process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True)
        while self._line("loading").strip() != "ready":
            pass

    def _line(self, what: str) -> str:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            raise RuntimeError(f"our measuring process ended while {what} (exit {self.process.returncode}; "
                               "its stderr is above)")
        return line

    def rate(self) -> float:
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        return float(self._line("measuring"))

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def _one_stream_rounds(bench: Path | None, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """tg: ours and llama-bench's, `args.rounds` adjacent pairs in alternating order (see above)."""
    ours = _OursKeptLoaded(str(path.resolve()), args)
    rounds: list[dict[str, float]] = []
    try:
        for index in range(args.rounds):
            figures: dict[str, float] = {}
            order = ("llama", "ours") if index % 2 == 0 else ("ours", "llama")
            for engine in order if bench else ("ours",):
                figures[engine] = (measure_llama_bench(bench, path, args.tokens, args.threads,
                                                       repetitions=args.runs_per_round)
                                   if engine == "llama" else ours.rate())
            rounds.append(figures)
            print(f"  tg{args.tokens} round {index + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()),
                  flush=True)
    finally:
        ours.close()
    row: dict[str, Any] = {"tg": statistics.mean(r["ours"] for r in rounds)}
    if bench:
        row["llama_tg"] = statistics.mean(r["llama"] for r in rounds)
        row["tg_ratio"] = statistics.median(r["ours"] / r["llama"] for r in rounds)
        row["tg_rounds"] = rounds
    return row


def _served(server_command: list[str], name: str, args: argparse.Namespace) -> dict[str, Any]:
    port = _free_port()
    started = time.perf_counter()
    server = _Server(name, [*server_command, "--port", str(port)], port)
    load = time.perf_counter() - started
    try:
        command = [sys.executable, str(args.serve_client), "--base-url", server.url, "-n", str(args.streams),
                   "--max-tokens", str(args.max_tokens), "--ignore-eos"]
        if args.prompts_file:
            command += ["--prompts-file", str(args.prompts_file)]
        result = subprocess.run(command, capture_output=True, text=True, check=True)
        report = json.loads(result.stdout[result.stdout.index("{"):])
    finally:
        rss = server.peak_rss_mib()
        server.stop()
    # The shared client's report: output_tok_s, and nested percentiles (ttft_ms.p50, ...).
    return {"output_tok_s": report["output_tok_s"], "errors": report["errors"],
            "ttft_p50_ms": report["ttft_ms"]["p50"], "tpot_p50_ms": report["tpot_ms"]["p50"],
            "ready_s": round(load, 2), "peak_rss_mib": rss}


def run_files(args: argparse.Namespace) -> int:
    if args.rounds < 1 or args.runs_per_round < 1:
        raise SystemExit(f"--rounds and --runs-per-round must be at least 1, got {args.rounds} and "
                         f"{args.runs_per_round}")
    results: dict[str, dict[str, Any]] = {}
    bench = args.llama_bin / "llama-bench" if args.llama_bin else None
    server = args.llama_bin / "llama-server" if args.llama_bin else None
    for path in args.files:
        row: dict[str, Any] = {}
        model = str(path.resolve())
        print(f"{path.name}:", flush=True)
        if bench and "tg" in args.parts:
            row["llama_pp"] = measure_llama_bench(bench, path, 0, args.threads, prompt=args.prompt_tokens)
            print(f"  llama-bench pp{args.prompt_tokens} {row['llama_pp']:.1f}", flush=True)
        if "tg" in args.parts:
            row.update(_one_stream_rounds(bench, path, args))
            prefill = _fresh("import json; from roseinfer.bench.gguf_files import measure_prefill; "
                             f"print(json.dumps(measure_prefill({model!r}, {args.prompt_tokens}, {args.threads}, "
                             f"{args.repeats})))")
            row.update(pp=prefill["pp"], load_s=prefill["load_s"])
            print(f"  roseinfer tg{args.tokens} {row['tg']:.1f}, pp{args.prompt_tokens} {row['pp']:.1f}, "
                  f"load {row['load_s']} s", flush=True)
        if args.serve_client and "served" in args.parts:
            blocks = -(-args.context * args.streams // 16)
            row["served"] = _served(_roseinfer("serve", "--model", model, "--max-num-seqs", str(args.streams),
                                               "--num-kv-blocks", str(blocks), "--max-model-len", str(args.context)),
                                    "roseinfer", args)
            print(f"  roseinfer served {row['served']}", flush=True)
            if server:
                row["llama_served"] = _served([str(server), "-m", model, "-np", str(args.streams), "-c",
                                               str(args.context * args.streams), "-t", str(args.threads),
                                               "--host", "127.0.0.1"], "llama-server", args)
                print(f"  llama-server served {row['llama_served']}", flush=True)
        results[path.name] = row
    _print_table(results, args)
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items() if k != "handler"},
                                         "load_average": os.getloadavg(), "results": results}, indent=2))
    return 0


def _ratio(ours: float | None, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}x" if ours and theirs else "-"


def _print_table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n{'file':<28}{'tg' + str(args.tokens):>20}{'pp' + str(args.prompt_tokens):>20}"
          f"{str(args.streams) + ' served':>22}{'peak RSS MiB':>22}{'ready s':>14}")
    for name, row in results.items():
        ours, theirs = row.get("served", {}), row.get("llama_served", {})
        tg_ratio = f"{row['tg_ratio']:.2f}x" if "tg_ratio" in row else "-"
        tg = f"{row['tg']:.1f} ({tg_ratio})" if "tg" in row else "-"
        pp = f"{row['pp']:.1f} ({_ratio(row['pp'], row.get('llama_pp'))})" if "pp" in row else "-"
        served = f"{ours.get('output_tok_s', '-')} ({_ratio(ours.get('output_tok_s'), theirs.get('output_tok_s'))})"
        rss = f"{ours.get('peak_rss_mib', '-')} / {theirs.get('peak_rss_mib', '-')}"
        ready = f"{ours.get('ready_s', row.get('load_s', '-'))} / {theirs.get('ready_s', '-')}"
        print(f"{name:<28}{tg:>20}{pp:>20}{served:>22}{rss:>22}{ready:>14}")
    print(f"(ours (ours / llama.cpp); tg: the mean over {args.rounds} round(s) (the median of the rounds' ratios); "
          "RSS and ready time: ours / llama-server's)")


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("gguf", help="GGUF files: tg, pp, served streams, memory and load against llama.cpp")
    parser.add_argument("--files", type=Path, nargs="+", required=True)
    parser.add_argument("--llama-bin", type=Path, default=None,
                        help="llama.cpp's build/bin (llama-bench, llama-server); peers skipped if not given")
    parser.add_argument("--serve-client", type=Path, default=None,
                        help="the shared serve_client.py; served figures skipped if not given")
    parser.add_argument("--prompts-file", type=Path, default=None, help="the client's prompts (JSONL)")
    parser.add_argument("--tokens", type=int, default=128, help="tg: tokens generated (default 128)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="pp: prompt tokens (default 512)")
    parser.add_argument("--streams", type=int, default=16, help="requests served at once (default 16)")
    parser.add_argument("--max-tokens", type=int, default=128, help="served: tokens per request (default 128)")
    parser.add_argument("--context", type=int, default=1024, help="served: context per stream (default 1024)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=2, help="pp: prompts timed (median)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="tg: adjacent pairs of llama-bench and ours, order alternating (default 1)")
    parser.add_argument("--runs-per-round", type=int, default=5,
                        help="tg: runs each engine averages in a round (llama-bench -r; default 5, its own)")
    parser.add_argument("--parts", nargs="+", choices=("tg", "served"), default=["tg", "served"],
                        help="tg: one stream and prompt processing (llama-bench and ours); served: both servers")
    parser.add_argument("--json", type=Path, default=None)
    parser.set_defaults(handler=run_files)
