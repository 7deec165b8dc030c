"""`roseinfer bench scale`: tensor and data parallelism on this machine, the whole table in one run.

  TP    `LLM.generate` offline, each configuration in a fresh process pinned to its cores: one
        rank on all cores, one rank on one core, and two ranks with one core each (their
        all-reduces through shared memory, and through gloo); one stream,
        and --streams requests at once; on the default model and on a random-weight Llama of
        about 1B parameters built here (cached in --workdir)
  comm  an all-reduce of one token's hidden state and of --streams tokens' between two ranks,
        one core each, through gloo and through shared memory: the price of each of a layer's
        two all-reduces under TP
  DP    --streams streams at once (`roseinfer bench serve`'s client) against one replica on one
        core, one replica on all cores, and two replicas with one core each behind the router

The load average is printed beside every figure: on a shared machine the figures are only
indicative. `--json` writes them all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

LLAMA_1B = {  # about 1.0B parameters: 20 layers of 45M, and a tied 49k x 2048 embedding
    "hidden_size": 2048, "intermediate_size": 5632, "num_layers": 20, "num_heads": 32, "num_kv_heads": 8,
    "head_dim": 64,
}


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def all_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


# -- the random-weight Llama ---------------------------------------------------------------
def build_random_llama(directory: Path) -> Path:
    """A Llama of LLAMA_1B's shape with the default model's tokenizer and N(0, 0.02) weights in
    bfloat16 (the engine computes in float32). Kept in `directory` for the next run."""
    import torch
    from safetensors.torch import save_file

    from roseinfer.models.default_model import default_model_path
    from roseinfer.models.export import hf_config, write_hf_tokenizer
    from roseinfer.models.gguf_file import GGUFFile
    from roseinfer.models.gguf_loader import model_config_from_gguf
    from roseinfer.tokenizer import Tokenizer

    marker = directory / "built.json"
    if marker.is_file() and json.loads(marker.read_text()) == LLAMA_1B:
        return directory
    gguf = GGUFFile(default_model_path())
    config = replace(model_config_from_gguf(gguf), **LLAMA_1B, max_position_embeddings=4096)
    tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    hidden, inner, head = config.hidden_size, config.intermediate_size, config.head_dim
    tensors = {"model.embed_tokens.weight": normal(config.vocab_size, hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        tensors |= {
            prefix + "self_attn.q_proj.weight": normal(config.num_heads * head, hidden),
            prefix + "self_attn.k_proj.weight": normal(config.num_kv_heads * head, hidden),
            prefix + "self_attn.v_proj.weight": normal(config.num_kv_heads * head, hidden),
            prefix + "self_attn.o_proj.weight": normal(hidden, config.num_heads * head),
            prefix + "mlp.gate_proj.weight": normal(inner, hidden),
            prefix + "mlp.up_proj.weight": normal(inner, hidden),
            prefix + "mlp.down_proj.weight": normal(hidden, inner),
            prefix + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf_config(config, "llama", tokenizer), indent=2))
    write_hf_tokenizer(tokenizer, config.max_position_embeddings, directory)
    parameters = sum(t.numel() for t in tensors.values())
    marker.write_text(json.dumps(LLAMA_1B))
    print(f"built a random Llama of {parameters / 1e9:.2f}B parameters in {directory}", flush=True)
    return directory


# -- cases run in a process of their own -----------------------------------------------------
def offline_case(model: str | None, tp: int, cores: list[int], streams: int, prompt_len: int,
                 output_len: int, allreduce: str = "shm") -> dict[str, Any]:
    """Output tokens per second of `streams` requests at once through LLM.generate."""
    os.sched_setaffinity(0, cores)
    import torch

    torch.set_num_threads(len(cores))
    from roseinfer import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=tp, kv_cache_memory=0.5, enable_prefix_caching=False,
              cpu_allreduce=allreduce)
    vocab = llm.llm_engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab - 1) for _ in range(prompt_len)]}
               for _ in range(streams)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], replace(params, max_tokens=4), use_tqdm=False)  # warm-up
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    llm.llm_engine.engine_core.shutdown()
    return {"tok_s": round(tokens / seconds, 2), "seconds": round(seconds, 2), "tokens": tokens}


def _allreduce_rank(rank: int, port: int, shapes: list[list[int]], result_path: str) -> None:
    import torch
    import torch.distributed as dist

    os.sched_setaffinity(0, [all_cores()[rank % len(all_cores())]])
    torch.set_num_threads(1)
    from roseinfer.distributed.shm_allreduce import SharedMemoryAllReduce

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    shared = SharedMemoryAllReduce(rank, 2, max(4 * a * b for a, b in shapes))
    latencies = {}
    for name, all_reduce in (("gloo", dist.all_reduce), ("shm", shared)):
        for shape in shapes:
            tensor = torch.randn(*shape)
            for _ in range(20):
                all_reduce(tensor)
            repeats = 200
            started = time.perf_counter()
            for _ in range(repeats):
                all_reduce(tensor)
            latencies[f"{name} {'x'.join(map(str, shape))}"] = round((time.perf_counter() - started) / repeats * 1e6, 1)
    dist.destroy_process_group()
    if rank == 0:
        Path(result_path).write_text(json.dumps(latencies))


def allreduce_case(shapes: list[list[int]]) -> dict[str, Any]:
    """Microseconds per gloo all-reduce of each shape (float32), two ranks, one core each."""
    import tempfile

    import torch.multiprocessing as mp

    from roseinfer.server.data_parallel import free_port

    port = free_port()
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        mp.spawn(_allreduce_rank, args=(port, shapes, result.name), nprocs=2)
        return json.loads(Path(result.name).read_text())


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """Run one case in a fresh interpreter (so that cores, threads and memory start clean)."""
    done = subprocess.run([sys.executable, "-m", "roseinfer.bench.scale", json.dumps(case)],
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"case {case} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result | {"load": load_average()}


# -- served cases ----------------------------------------------------------------------------
def _wait_healthy(url: str, process: subprocess.Popen, timeout: float = 600.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited (code {process.returncode})")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up")


def served_case(flags: list[str], cores: list[int], streams: int, output_len: int) -> dict[str, Any]:
    """Output tokens per second of `streams` streams at once against `roseinfer serve FLAGS`."""
    from roseinfer.bench.prompts import user_messages
    from roseinfer.bench.serve import run_load
    from roseinfer.server.data_parallel import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "roseinfer.cli", "--log-level", "WARNING", "serve", "--port", str(port),
               "--disable-web-ui", "--kv-cache-memory", "0.5", *flags]
    server = subprocess.Popen(command, preexec_fn=lambda: os.sched_setaffinity(0, cores),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_healthy(url, server)
        workload = [(text, output_len) for text in user_messages(streams)]
        asyncio.run(run_load(url, None, workload[:4]))  # warm-up
        summary = asyncio.run(run_load(url, None, workload))
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return {"tok_s": summary["output_throughput"], "ttft_p50_ms": summary["ttft_p50_ms"],
            "failed": summary["failed"], "load": load_average()}


# -- the table -------------------------------------------------------------------------------
def run_scale_bench(args: argparse.Namespace) -> int:
    cores = all_cores()
    if len(cores) < 2:
        print("bench scale needs at least 2 cores", file=sys.stderr)
        return 2
    two, one = cores[:2], cores[:1]
    print(f"cores {cores}; load average at start {load_average():.2f}", flush=True)
    results: dict[str, Any] = {"cores": cores}
    rows: list[str] = []

    models: list[tuple[str, str | None, int, int]] = [("default (SmolLM2-135M)", None, args.prompt_len, args.output_len)]
    if not args.skip_1b:
        path = build_random_llama(Path(args.workdir) / "llama-1b")
        models.append(("random Llama 1.0B", str(path), 16, 16))
    rows += ["| model | configuration | 1 stream tok/s | "
             f"{args.streams} at once tok/s | load |", "|---|---|---|---|---|"]
    for label, model, prompt_len, output_len in models:
        for name, tp, case_cores, allreduce in (
            ("TP=1, 2 cores", 1, two, "shm"), ("TP=1, 1 core", 1, one, "shm"),
            ("TP=2, 1 core per rank, shared-memory all-reduce", 2, two, "shm"),
            ("TP=2, 1 core per rank, gloo all-reduce", 2, two, "gloo"),
        ):
            common = {"kind": "offline", "model": model, "tp": tp, "cores": case_cores, "prompt_len": prompt_len,
                      "allreduce": allreduce}
            single = run_case(common | {"streams": 1, "output_len": args.single_output_len})
            many = run_case(common | {"streams": args.streams, "output_len": output_len})
            results[f"{label} / {name}"] = {"single": single, "many": many}
            rows.append(f"| {label} | {name} | {single['tok_s']:.1f} | {many['tok_s']:.1f} | "
                        f"{single['load']:.1f} / {many['load']:.1f} |")
            print(rows[-1], flush=True)

    latencies = run_case({"kind": "allreduce", "shapes": [[1, 576], [args.streams, 576], [1, 2048],
                                                           [args.streams, 2048]]})
    results["allreduce_us"] = latencies
    print(f"all-reduce, 2 ranks, one core each (microseconds): {latencies}", flush=True)

    rows += ["", f"| served, {args.streams} streams at once (default model) | output tok/s | TTFT p50 | load |",
             "|---|---|---|---|"]
    served = [("1 replica, 1 core", [], one), ("1 replica, 2 cores", [], two)]
    for router in args.routers:
        for policy in args.router_policies:
            served.append((f"2 replicas x 1 core, {router} {policy}",
                           ["--data-parallel-size", "2", "--data-parallel-base-port", "0", "--router", router,
                            "--router-policy", policy], two))
    for name, flags, case_cores in served:
        figures = served_case(flags, case_cores, args.streams, args.served_output_len)
        results[f"served / {name}"] = figures
        rows.append(f"| {name} | {figures['tok_s']:.1f} | {figures['ttft_p50_ms']:.0f} ms | {figures['load']:.1f} |"
                    + (f" ({figures['failed']} failed)" if figures["failed"] else ""))
        print(rows[-1], flush=True)

    print("\n" + "\n".join(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("scale", help="tensor parallelism (1 vs 2 ranks) and data parallelism "
                                            "(1 vs 2 replicas behind the router) on this machine")
    parser.add_argument("--streams", type=int, default=64, help="requests at once (default 64)")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens, default model (default 32)")
    parser.add_argument("--output-len", type=int, default=32, help="output tokens per request at once (default 32)")
    parser.add_argument("--single-output-len", type=int, default=64, help="output tokens of one stream (default 64)")
    parser.add_argument("--served-output-len", type=int, default=64, help="output tokens per served stream")
    parser.add_argument("--skip-1b", action="store_true", help="leave out the random 1B Llama")
    parser.add_argument("--workdir", default="/tmp/roseinfer-bench-scale", help="where the 1B Llama is kept")
    parser.add_argument("--routers", nargs="*", default=["vllm-router"], help="routers to measure (none: skip)")
    parser.add_argument("--router-policies", nargs="+", default=["power_of_two"], help="policies to measure")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.set_defaults(handler=run_scale_bench)


if __name__ == "__main__":  # one case, in a fresh interpreter (run_case)
    spec = json.loads(sys.argv[1])
    kind = spec.pop("kind")
    print(json.dumps(offline_case(**spec) if kind == "offline" else allreduce_case(**spec)))
