"""`roseinfer bench quality`: how far a quantized (or lower-precision) engine's greedy output
strays from the float32 model's, on the chat prompts the tests use.

Reports, for each candidate against float32 with no quantization:
  agreement      fraction of output positions where both chose the same token;
  common prefix  fraction of output tokens generated before the first disagreement.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

from roseinfer.bench.prompts import chat_prompt_ids, model_tokenizer, user_chats
from roseinfer.config import add_engine_args, engine_args_from_cli
from roseinfer.layers.linear import QUANTIZATION_METHODS


def _greedy(settings: dict, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    from roseinfer import LLM, SamplingParams

    llm = LLM(**settings)
    started = time.perf_counter()
    outputs = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        use_tqdm=False,
    )
    elapsed = time.perf_counter() - started
    del llm
    gc.collect()
    return [o.outputs[0].token_ids for o in outputs], elapsed


def compare(reference: list[list[int]], candidate: list[list[int]]) -> dict[str, float]:
    total = same = prefix = 0
    for ref, cand in zip(reference, candidate, strict=True):
        total += len(ref)
        same += sum(a == b for a, b in zip(ref, cand, strict=True))
        common = next((i for i, (a, b) in enumerate(zip(ref, cand, strict=True)) if a != b), len(ref))
        prefix += common
    return {"agreement": same / total, "common_prefix": prefix / total}


def run_quality(args: argparse.Namespace) -> int:
    base = engine_args_from_cli(args)
    prompts = chat_prompt_ids(model_tokenizer(base), user_chats(args.num_prompts))
    reference, _ = _greedy(base | {"dtype": "float32", "quantization": "none"}, prompts, args.max_tokens)
    rows = []
    for method in args.methods:
        dtype, _, quantization = method.partition("+")
        settings = base | {"dtype": dtype or "float32", "quantization": quantization or "none"}
        candidate, seconds = _greedy(settings, prompts, args.max_tokens)
        rows.append({"method": method, **compare(reference, candidate), "seconds": seconds})

    print(f"\ngreedy agreement with float32, {len(prompts)} chat prompts x {args.max_tokens} tokens")
    print(f"{'dtype+quantization':<28} {'agreement':>10} {'common prefix':>14} {'seconds':>8}")
    for row in rows:
        print(f"{row['method']:<28} {row['agreement']:>10.3f} {row['common_prefix']:>14.3f} {row['seconds']:>8.1f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("quality", help="greedy agreement of quantized kernels with float32")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    choices = [f"{d}+{q}" for d in ("float32", "bfloat16") for q in QUANTIZATION_METHODS]
    parser.add_argument("--methods", nargs="+", default=["float32+int8", "float32+int4", "float32+dynamic-int8",
                                                         "bfloat16+none"],
                        metavar="DTYPE+QUANTIZATION", help=f"from {', '.join(choices)}")
    parser.add_argument("--json", type=Path, default=None)
    add_engine_args(parser)
    parser.set_defaults(handler=run_quality)
