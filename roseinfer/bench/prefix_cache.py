"""`roseinfer bench prefix-cache`: N requests that share a long system prompt, all queued at once,
with the prefix cache on and then off. Prints time to first token (TTFT, arrival to first token)
for both, the ratio of their medians, and checks that the outputs are identical."""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from pathlib import Path

from roseinfer.bench.prompts import chat_prompt_ids, model_tokenizer, user_chats
from roseinfer.engine.arg_utils import add_engine_args, engine_args_from_cli

_POLICY = (
    "Section {n}. The assistant answers questions for the staff of a regional hospital. It "
    "explains procedures plainly, cites the relevant internal guideline by its number, never "
    "gives a diagnosis, and tells the reader whom to call when a question needs a clinician. "
)


def system_prompt(tokenizer, num_tokens: int) -> str:
    """A system prompt of at least `num_tokens` tokens (numbered sections, so no two alike)."""
    text, n = "", 1
    while len(tokenizer.encode(text, add_special_tokens=False)) < num_tokens:
        text += _POLICY.format(n=n)
        n += 1
    return text


def _run(settings: dict, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], list[list[int]]]:
    from roseinfer import LLM, SamplingParams

    llm = LLM(**settings)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    del llm
    gc.collect()
    return ttfts, [o.outputs[0].token_ids for o in outputs]


def run_prefix_bench(args: argparse.Namespace) -> int:
    settings = engine_args_from_cli(args)
    tokenizer = model_tokenizer(settings)
    system = system_prompt(tokenizer, args.system_tokens)
    prompts = chat_prompt_ids(tokenizer, [
        [{"role": "system", "content": system}, *chat] for chat in user_chats(args.num_prompts)
    ])
    cached_ttft, cached_out = _run(settings | {"enable_prefix_caching": True}, prompts, args.max_tokens)
    plain_ttft, plain_out = _run(settings | {"enable_prefix_caching": False}, prompts, args.max_tokens)
    with_p50, without_p50 = statistics.median(cached_ttft), statistics.median(plain_ttft)
    identical = cached_out == plain_out
    print(f"\n{len(prompts)} requests sharing a {args.system_tokens}-token system prompt "
          f"(prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens), all at once, "
          f"{args.max_tokens} new tokens each")
    print(f"  TTFT p50 with prefix caching     {1000 * with_p50:9.1f} ms")
    print(f"  TTFT p50 without prefix caching  {1000 * without_p50:9.1f} ms")
    print(f"  ratio {without_p50 / with_p50:.1f}x; outputs identical: {identical}")
    if args.json:
        args.json.write_text(json.dumps({
            "ttft_p50_ms_cached": 1000 * with_p50, "ttft_p50_ms_uncached": 1000 * without_p50,
            "ratio": without_p50 / with_p50, "outputs_identical": identical,
        }, indent=2))
    return 0 if identical else 1


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("prefix-cache", help="TTFT with and without prefix caching on a shared prompt")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None)
    add_engine_args(parser)
    parser.set_defaults(handler=run_prefix_bench)
