"""`roseinfer bench compare`: roseinfer and its peers on one workload, in one run, one table.

Measured here, each in a process of its own so that none runs while another is measured:
  * transformers `generate`, float32, static batches (16 and 64) and a single stream;
  * roseinfer offline (`LLM.generate`), float32, batched and single stream, plus the single stream
    with each quantization method;
  * every server (roseinfer, vLLM's CPU server with --vllm-python, llama.cpp's llama-server with
    --llama-server) through the same client (`bench serve`): all requests at once, Poisson arrivals
    at --rate, and one request alone. vLLM serves the Hugging Face directory `export-hf` writes
    from the same GGUF file; llama-server serves the GGUF file itself.
A peer that is not given is skipped with a note. The table is printed and written as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from roseinfer.bench.serve import run_load

QUANTIZATIONS = ("int8", "int4")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _roseinfer(*args: str) -> list[str]:
    return [sys.executable, "-m", "roseinfer.cli", "--log-level", "WARNING", *args]


def _offline(args: argparse.Namespace, extra: list[str]) -> list[dict[str, Any]]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = _roseinfer("bench", "offline", "--num-prompts", str(args.num_prompts), "--max-tokens",
                             str(args.max_tokens), "--json", out.name, *extra)
        if args.prompts_file:
            command += ["--prompts-file", str(args.prompts_file)]
        if args.model:
            command += ["--model", str(args.model)]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())["results"]


class _Server:
    """A server process on a free port of 127.0.0.1, ready once /health answers."""

    def __init__(self, name: str, command: list[str], port: int, env: dict[str, str] | None = None,
                 startup_timeout: float = 900) -> None:
        import httpx

        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)  # noqa: SIM115
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env=os.environ | (env or {}))
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{name} exited while starting; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"{name} did not start in {startup_timeout:.0f}s; see {self.log.name}")

    def peak_rss_mib(self) -> float:
        """The peak resident memory (VmHWM) of the server's process and its children (vLLM runs
        its engine in a child process), summed: pages two of them share are counted twice."""
        total_kib, pending = 0, [self.process.pid]
        while pending:
            pid = pending.pop()
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                for task in Path(f"/proc/{pid}/task").iterdir():
                    pending += [int(child) for child in (task / "children").read_text().split()]
            except OSError:  # gone, or not Linux
                continue
            total_kib += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
        return round(total_kib / 1024, 1)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def _served(server: _Server, args: argparse.Namespace) -> dict[str, Any]:
    from roseinfer.bench.serve import build_workload

    load = argparse.Namespace(seed=0, output_len=args.max_tokens, range_ratio=0.0, prompts_file=args.prompts_file,
                              num_prompts=args.num_prompts, token_ids=False, dataset="questions", input_len=0)
    workload = build_workload(load)
    results = {}
    for label, rate, requests in (("all_at_once", float("inf"), workload),
                                  ("poisson", args.rate, workload),
                                  ("single_stream", float("inf"), workload[:1])):
        results[label] = asyncio.run(run_load(server.url, None, requests, rate, None, True, 0))
        print(f"  {server.name} {label}: {results[label]['output_throughput']} tok/s, "
              f"TTFT p50 {results[label]['ttft_p50_ms']} ms, TPOT p50 {results[label]['tpot_p50_ms']} ms",
              flush=True)
    return results


def _servers(args: argparse.Namespace) -> list[tuple[str, list[str], dict[str, str]]]:
    from roseinfer.models.default_model import default_model_path

    gguf = Path(args.model) if args.model else default_model_path()
    port = _free_port()
    model = ["--model", str(gguf)] if args.model else []
    servers = [("roseinfer", _roseinfer("serve", "--port", str(port), *model), {}, port)]
    for variant in args.roseinfer_variant:
        port = _free_port()
        servers.append((f"roseinfer {variant}", _roseinfer("serve", "--port", str(port), *model, *variant.split()),
                        {}, port))
    if args.vllm_python:
        hf_dir = Path(tempfile.gettempdir()) / f"roseinfer-export-{gguf.stem}"
        if not (hf_dir / "config.json").is_file():
            subprocess.run(_roseinfer("export-hf", "--model", str(gguf), "--output", str(hf_dir)), check=True)
        for dtype in args.vllm_dtype:
            port = _free_port()
            servers.append((_vllm_name(dtype), [
                args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
                "--served-model-name", gguf.stem, "--port", str(port), "--dtype", dtype,
                "--max-num-seqs", str(args.num_prompts),
            ], {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}"}, port))
    else:
        print("note: vLLM skipped (give --vllm-python PATH, a Python with `vllm` importable)")
    if args.llama_server:
        port = _free_port()
        servers.append(("llama.cpp", [args.llama_server, "-m", str(gguf), "--port", str(port), "-t", "2",
                                      "-np", str(args.llama_parallel), "-c", str(4096 * args.llama_parallel)],
                        {}, port))
    else:
        print("note: llama.cpp skipped (give --llama-server PATH to a llama-server binary)")
    return [(name, command, env | {"_PORT": str(port)}) for name, command, env, port in servers]


def _vllm_name(dtype: str) -> str:
    return "vLLM" if dtype == "float32" else f"vLLM {dtype}"


def run_compare(args: argparse.Namespace) -> int:
    report: dict[str, Any] = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
                              "workload": {"prompts": args.num_prompts, "max_tokens": args.max_tokens,
                                           "prompts_file": str(args.prompts_file or "built-in"), "rate": args.rate}}
    print("offline: roseinfer and transformers ...", flush=True)
    hf = [] if args.skip_transformers else ["--hf-batch-size", "16", "64"]
    report["offline"] = _offline(args, hf if hf else ["--skip-transformers"])
    for method in QUANTIZATIONS:
        print(f"offline single stream, --quantization {method} ...", flush=True)
        rows = _offline(args, ["--skip-transformers", "--no-batched", "--quantization", method])
        report["offline"] += [row | {"system": f"{row['system']} ({method})"} for row in rows]
    report["served"] = {}
    for name, command, env in _servers(args):
        print(f"served: {name} ...", flush=True)
        port = int(env.pop("_PORT"))
        try:
            server = _Server(name, command, port, env)
        except RuntimeError as exc:
            print(f"note: {name} skipped: {exc}")
            continue
        try:
            report["served"][name] = _served(server, args)
            report["served"][name]["peak_rss_mib"] = server.peak_rss_mib()
        finally:
            server.stop()
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def print_report(report: dict[str, Any]) -> None:
    offline = {row["system"]: row["tokens_per_second"] for row in report["offline"]}
    served = report["served"]
    print(f"\nmachine: {report['machine']}; workload: {report['workload']}")
    width = max([len(f"{name} (offline)") for name in offline] + [len(f"{name} (served)") for name in served] + [6])
    print(f"{'system':<{width}} {'tok/s (batch)':>13} {'TTFT p50':>9} {'Poisson TTFT/TPOT p50':>22} {'1 stream':>9} "
          f"{'peak RSS':>9}")
    for system, value in offline.items():
        if "single-stream" in system:
            continue
        single = offline.get(system.replace("roseinfer", "roseinfer single-stream")
                             if system.startswith("roseinfer") else "transformers single-stream")
        print(f"{system + ' (offline)':<{width}} {value:>13.1f} {'':>9} {'':>22} {single or 0:>9.1f}")
    for system, value in offline.items():
        if system.startswith("roseinfer single-stream ("):
            print(f"{system + ' (offline)':<{width}} {'':>13} {'':>9} {'':>22} {value:>9.1f}")
    for name, runs in served.items():
        a, p, s = runs["all_at_once"], runs["poisson"], runs["single_stream"]
        rss = f"{runs['peak_rss_mib']:.0f} MiB" if runs.get("peak_rss_mib") else ""
        print(f"{name + ' (served)':<{width}} {a['output_throughput']:>13.1f} {a['ttft_p50_ms']:>7.0f}ms "
              f"{p['ttft_p50_ms']:>10.0f} / {p['tpot_p50_ms']:>6.1f} ms {s['output_throughput']:>9.1f} {rss:>9}")
    print()
    best_hf = max((v for k, v in offline.items() if k.startswith("transformers (static")), default=None)
    if best_hf and "roseinfer" in offline:
        print(f"offline roseinfer / best transformers batch: {offline['roseinfer'] / best_hf:.2f}x "
              f"(target >= 2x and >= 400 tok/s; roseinfer {offline['roseinfer']:.0f} tok/s)")
    ours = served.get("roseinfer")
    if ours and "vLLM" in served:
        vllm = served["vLLM"]["all_at_once"]
        print(f"served roseinfer / vLLM: {ours['all_at_once']['output_throughput'] / vllm['output_throughput']:.2f}x "
              f"(target >= 1.5x); TTFT p50 {ours['all_at_once']['ttft_p50_ms']:.0f} vs {vllm['ttft_p50_ms']:.0f} ms")
        for name, runs in served.items():
            if name.startswith("roseinfer "):  # the variants (other dtypes, quantization): like with like
                peer_name = "vLLM bfloat16" if "bfloat16" in name and "--dtype" in name else "vLLM"
                peer = served.get(peer_name, {}).get("all_at_once")
                if peer:
                    print(f"served {name} / {peer_name}: "
                          f"{runs['all_at_once']['output_throughput'] / peer['output_throughput']:.2f}x")
    if ours:
        print(f"Poisson: TTFT p50 {ours['poisson']['ttft_p50_ms']:.0f} ms (target <= 200), "
              f"TPOT p50 {ours['poisson']['tpot_p50_ms']:.1f} ms (target <= 42)")
    singles = {k: v for k, v in offline.items() if "single-stream" in k and k.startswith("roseinfer")}
    if singles:
        best = max(singles, key=singles.get)
        peer = served.get("llama.cpp", {}).get("single_stream", {}).get("output_throughput")
        print(f"single stream: best {best} {singles[best]:.1f} tok/s (target >= llama.cpp: "
              f"{f'{peer:.1f} tok/s measured' if peer else '58 tok/s reported, not measured here'})")


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("compare", help="roseinfer against transformers, vLLM and llama.cpp in one run")
    parser.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--prompts-file", type=Path, default=None,
                        help="JSON lines with 'prompt' and 'prompt_ids' (e.g. ../shared/bench/workload.jsonl)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rate", type=float, default=1.0, help="Poisson arrival rate, requests/s")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--vllm-python", default=None, help="a Python interpreter that can import vllm")
    parser.add_argument("--vllm-dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                        help="vLLM's --dtype, one server each (default: float32)")
    parser.add_argument("--llama-server", default=None, help="a llama-server binary")
    parser.add_argument("--llama-parallel", type=int, default=16, help="llama-server -np (slots)")
    parser.add_argument("--roseinfer-variant", action="append", default=[], metavar="FLAGS",
                        help="also serve roseinfer with these flags, e.g. '--dtype bfloat16' (repeatable)")
    parser.add_argument("--json", type=Path, default=None)
    parser.set_defaults(handler=run_compare)
