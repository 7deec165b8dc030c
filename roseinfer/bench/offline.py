"""`roseinfer bench offline`: offline throughput against transformers `generate`, in one run.

Workload: N chat prompts (default 64; built-in questions in the model's chat template, or the
`prompt_ids` of a --prompts-file such as ../shared/bench/workload.jsonl), M new tokens each
(default 128), greedy, EOS ignored. Both systems get the same prompt token ids. transformers runs
static batches (--hf-batch-size, default 16; several may be given), float32, left padded, as a
user of `generate` would. Also single-stream decode: one request, M tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from roseinfer.bench.prompts import chat_prompt_ids, user_chats
from roseinfer.engine.arg_utils import add_engine_args, engine_args_from_cli
from roseinfer.step_timings import StepTimings


@dataclass
class Measurement:
    system: str
    requests: int
    output_tokens: int
    seconds: float
    timings: StepTimings | None = None  # roseinfer's own: where its step time went

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


def _measure_roseinfer(llm, args: argparse.Namespace, prompts: list[list[int]]) -> list[Measurement]:
    from roseinfer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=SamplingParams(max_tokens=4), use_tqdm=False)
    llm.reset_prefix_cache()  # the warm-up must not prefill the workload's prompts

    def run(name: str, batch: list[list[int]]) -> Measurement:
        before = llm.llm_engine.timings.snapshot()
        started = time.perf_counter()
        outputs = llm.generate(prompt_token_ids=batch, sampling_params=params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        return Measurement(name, len(batch), tokens, elapsed, llm.llm_engine.timings.since(before))

    results = [run("roseinfer", prompts)] if args.batched else []
    if args.single_stream:
        results.append(run("roseinfer single-stream", prompts[:1]))
    return results


def _load_transformers(model: str | None):
    from transformers import AutoModelForCausalLM

    from roseinfer.models.default_model import default_model_path

    path = Path(model) if model else default_model_path()
    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@torch.inference_mode()
def _transformers(args: argparse.Namespace, prompts: list[list[int]], pad_id: int) -> list[Measurement]:
    model = _load_transformers(args.model)

    def run(batch: list[list[int]]) -> int:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=args.max_tokens,
            min_new_tokens=args.max_tokens, do_sample=False, pad_token_id=pad_id,
        )
        return (out.shape[1] - width) * len(batch)

    run(prompts[:2])  # warm-up
    results = []
    for batch_size in args.hf_batch_size if args.batched else []:
        started, tokens = time.perf_counter(), 0
        for start in range(0, len(prompts), batch_size):
            tokens += run(prompts[start : start + batch_size])
        results.append(Measurement(f"transformers (static batch {batch_size})", len(prompts), tokens,
                                   time.perf_counter() - started))
    if args.single_stream:
        started = time.perf_counter()
        tokens = run(prompts[:1])
        results.append(Measurement("transformers single-stream", 1, tokens, time.perf_counter() - started))
    return results


def workload_token_ids(tokenizer, count: int, prompts_file: Path | None) -> list[list[int]]:
    """`count` prompts as token ids: from a JSON-lines file, or built-in questions as chats."""
    if prompts_file is not None:
        rows = [json.loads(line) for line in prompts_file.read_text().splitlines() if line.strip()]
        return [row["prompt_ids"] for row in rows[:count]]
    return chat_prompt_ids(tokenizer, user_chats(count))


def run_offline(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    # roseinfer's tokenizer and chat template make the prompt ids; both systems get the same ids.
    from roseinfer import LLM

    llm = LLM(**engine_args_from_cli(args))
    engine = llm.llm_engine
    tokenizer = engine.tokenizer
    prompts = workload_token_ids(tokenizer, args.num_prompts, args.prompts_file)
    ours = _measure_roseinfer(llm, args, prompts)
    theirs: list[Measurement] = []
    if not args.skip_transformers:
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        theirs = _transformers(args, prompts, pad)
    _print_table(args, ours + theirs)
    if args.json:
        write_json(args.json, ours + theirs, {"model": engine.model_name, "device": str(engine.config.torch_device)})
    return 0


def _print_table(args: argparse.Namespace, rows: list[Measurement]) -> None:
    print(f"\noffline: {args.num_prompts} prompts x {args.max_tokens} new tokens, greedy, EOS ignored, "
          f"{torch.get_num_threads()} threads")
    print(f"{'system':<40} {'requests':>8} {'tokens':>8} {'seconds':>8} {'tok/s':>8}")
    for row in rows:
        print(f"{row.system:<40} {row.requests:>8} {row.output_tokens:>8} {row.seconds:>8.2f} "
              f"{row.tokens_per_second:>8.1f}")
    by_name = {row.system: row for row in rows}
    batched = [row for row in rows if row.system.startswith("transformers (static")]
    if batched and "roseinfer" in by_name:
        best = max(batched, key=lambda row: row.tokens_per_second)
        ratio = by_name["roseinfer"].tokens_per_second / best.tokens_per_second
        print(f"ratio roseinfer / {best.system}, the best of transformers: {ratio:.2f}x")
    single = by_name.get("transformers single-stream")
    if single and "roseinfer single-stream" in by_name:
        ratio = by_name["roseinfer single-stream"].tokens_per_second / single.tokens_per_second
        print(f"ratio roseinfer / transformers (single stream): {ratio:.2f}x")
    if args.profile:
        for row in rows:
            if row.timings is not None:
                print_step_profile(row.system, row.timings)


def print_step_profile(name: str, timings: StepTimings) -> None:
    """Per-step milliseconds of each phase; everything but `forward` is engine overhead."""
    steps = max(timings.steps, 1)
    print(f"\n{name}: {timings.steps} steps, {1000 * timings.total / steps:.1f} ms per step")
    for phase in StepTimings.PHASES:
        seconds = getattr(timings, phase)
        print(f"  {phase:<10} {1000 * seconds / steps:8.2f} ms  {100 * seconds / max(timings.total, 1e-9):5.1f}%")
    print(f"  engine overhead (all but forward): {100 * timings.overhead_fraction:.1f}% of step time")


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("offline", help="offline throughput vs transformers generate")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    parser.add_argument("--hf-batch-size", type=int, nargs="+", default=[16],
                        help="transformers' static batch size(s)")
    parser.add_argument("--prompts-file", type=Path, default=None,
                        help="JSON lines with 'prompt_ids' (e.g. ../shared/bench/workload.jsonl)")
    parser.add_argument("--no-batched", dest="batched", action="store_false",
                        help="only the single-stream measurements")
    parser.add_argument("--skip-transformers", action="store_true", help="measure roseinfer only")
    parser.add_argument("--no-single-stream", dest="single_stream", action="store_false")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--profile", action="store_true",
                        help="print where roseinfer's step time goes (schedule, prepare, forward, ...)")
    add_engine_args(parser)
    parser.set_defaults(handler=run_offline)


def write_json(path: Path, rows: list[Measurement], extra: dict) -> None:
    payload = {
        "results": [
            asdict(r) | {"tokens_per_second": r.tokens_per_second}
            | ({"overhead_fraction": r.timings.overhead_fraction} if r.timings else {})
            for r in rows
        ],
        **extra,
    }
    path.write_text(json.dumps(payload, indent=2))
