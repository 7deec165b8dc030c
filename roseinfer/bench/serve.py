"""`roseinfer bench serve`: load any OpenAI-compatible /v1/completions endpoint (ours or a peer's)
and report what its users feel: request and token throughput, time to first token (TTFT), time
per output token (TPOT) and inter-token latency (ITL).

Requests stream (stream=true, usage requested), greedy, all at once or with Poisson arrivals at
--request-rate, at most --max-concurrency in flight. Output tokens are counted from the server's
`usage` when it sends it, otherwise from the text chunks. httpx is the client: it is already a
dependency of the server's stack and streams with asyncio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roseinfer.bench.prompts import user_messages


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    chunk_gaps: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentiles(values: list[float], prefix: str, scale: float = 1000.0) -> dict[str, float | None]:
    """mean, p50, p90, p99 in milliseconds (linear interpolation between ranks)."""
    if not values:
        return {f"{prefix}_{k}_ms": None for k in ("mean", "p50", "p90", "p99")}
    ordered = sorted(values)

    def rank(p: float) -> float:
        position = (len(ordered) - 1) * p / 100
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    return {
        f"{prefix}_mean_ms": round(statistics.fmean(ordered) * scale, 2),
        f"{prefix}_p50_ms": round(rank(50) * scale, 2),
        f"{prefix}_p90_ms": round(rank(90) * scale, 2),
        f"{prefix}_p99_ms": round(rank(99) * scale, 2),
    }


def build_workload(args: argparse.Namespace) -> list[tuple[str | list[int], int]]:
    """(prompt, max_tokens) per request: a prompts file, random token ids, or built-in questions."""
    rng = random.Random(args.seed)

    def output_len() -> int:
        low = max(1, int(args.output_len * (1 - args.range_ratio)))
        return rng.randint(low, max(low, int(args.output_len * (1 + args.range_ratio))))

    if args.prompts_file:
        rows = [json.loads(line) for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
        rows = rows[: args.num_prompts]
        key = "prompt_ids" if args.token_ids else "prompt"
        return [(row[key], output_len()) for row in rows]
    if args.dataset == "random":
        workload = []
        for _ in range(args.num_prompts):
            low = max(1, int(args.input_len * (1 - args.range_ratio)))
            length = rng.randint(low, max(low, int(args.input_len * (1 + args.range_ratio))))
            workload.append(([rng.randrange(1000, 20000) for _ in range(length)], output_len()))
        return workload
    return [(text, output_len()) for text in user_messages(args.num_prompts)]


async def _one(client, url: str, body: dict[str, Any], result: RequestResult) -> None:
    started = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if payload.get("error"):
                    result.error = str(payload["error"])
                    return
                usage = payload.get("usage")
                if usage:
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                    result.prompt_tokens = usage.get("prompt_tokens")
                for choice in payload.get("choices") or []:
                    if choice.get("text"):
                        now = time.perf_counter()
                        if last is None:
                            result.ttft = now - started
                        else:
                            result.chunk_gaps.append(now - last)
                        last = now
                        chunks += 1
        result.latency = time.perf_counter() - started
        result.output_tokens = result.output_tokens or chunks
        result.ok = last is not None
        if not result.ok:
            result.error = "no text was streamed"
    except Exception as exc:  # count it, keep the run going
        result.error = f"{type(exc).__name__}: {exc}"


async def run_load(
    base_url: str,
    model: str | None,
    workload: list[tuple[str | list[int], int]],
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
    ignore_eos: bool = True,
    seed: int = 0,
    api_key: str | None = None,
) -> dict[str, Any]:
    """Send the workload; returns the summary."""
    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=httpx.Timeout(None), limits=limits) as client:
        if model is None:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
        results = [RequestResult() for _ in workload]
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        rng = random.Random(seed)

        async def send(index: int) -> None:
            prompt, max_tokens = workload[index]
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                    "stream": True, "stream_options": {"include_usage": True}}
            if ignore_eos:
                body["ignore_eos"] = True
            if gate is None:
                await _one(client, "/v1/completions", body, results[index])
            else:
                async with gate:
                    await _one(client, "/v1/completions", body, results[index])

        started = time.perf_counter()
        tasks = []
        for index in range(len(workload)):
            tasks.append(asyncio.create_task(send(index)))
            if request_rate != float("inf") and index + 1 < len(workload):
                await asyncio.sleep(rng.expovariate(request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    return summarize(results, duration, model, request_rate, max_concurrency)


def summarize(results: list[RequestResult], duration: float, model: str, rate: float,
              concurrency: int | None) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)
    summary: dict[str, Any] = {
        "model": model,
        "request_rate": "inf" if rate == float("inf") else rate,
        "max_concurrency": concurrency,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": round(duration, 3),
        "request_throughput": round(len(done) / duration, 3),
        "output_tokens": output,
        "output_throughput": round(output / duration, 2),
    }
    summary |= percentiles([r.ttft for r in done], "ttft")
    summary |= percentiles([t for r in done if (t := r.tpot) is not None], "tpot")
    summary |= percentiles([g for r in done for g in r.chunk_gaps], "itl")
    summary["e2e_p50_ms"] = percentiles([r.latency for r in done], "e2e")["e2e_p50_ms"]
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    print(f"\nserved: {summary['completed']} completed, {summary['failed']} failed in {summary['duration_s']} s "
          f"(rate {summary['request_rate']} req/s, max concurrency {summary['max_concurrency']})")
    print(f"  request throughput  {summary['request_throughput']:.2f} req/s")
    print(f"  output throughput   {summary['output_throughput']:.1f} tok/s")
    for name in ("ttft", "tpot", "itl"):
        values = [summary[f"{name}_{k}_ms"] for k in ("mean", "p50", "p90", "p99")]
        shown = " / ".join("-" if v is None else f"{v:.1f}" for v in values)
        print(f"  {name.upper():<5} mean / p50 / p90 / p99  {shown} ms")
    for error in summary["errors"]:
        print(f"  error: {error}")


def run_serve_bench(args: argparse.Namespace) -> int:
    workload = build_workload(args)
    summary = asyncio.run(run_load(
        args.base_url.rstrip("/"), args.model, workload, args.request_rate, args.max_concurrency,
        args.ignore_eos, args.seed, args.api_key,
    ))
    print_summary(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if summary["failed"] == 0 else 1


def add_load_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", "-n", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Poisson arrivals at this many requests/s (default: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length")
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (--dataset random)")
    parser.add_argument("--range-ratio", type=float, default=0.0,
                        help="draw lengths uniformly within +-ratio of --input-len/--output-len")
    parser.add_argument("--dataset", choices=("questions", "random"), default="questions",
                        help="built-in questions (text) or random token ids")
    parser.add_argument("--prompts-file", default=None,
                        help="JSON lines with 'prompt' (and 'prompt_ids'), e.g. ../shared/bench/workload.jsonl")
    parser.add_argument("--token-ids", action="store_true", help="send the file's prompt_ids instead of text")
    parser.add_argument("--seed", type=int, default=0)


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("serve", help="load an OpenAI-compatible server and report TTFT/TPOT/ITL")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the summary here")
    add_load_args(parser)
    parser.set_defaults(handler=run_serve_bench)
