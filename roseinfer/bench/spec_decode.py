"""`roseinfer bench spec`: single-stream speed with n-gram speculative decoding against without, in
one run, on input-grounded prompts (editing or summarising a given text or code: 32 of them, built
from the shipped corpus and from roseinfer's own source) and on the chat workload.

Greedy, so both runs must give the same tokens (checked); each prompt runs alone, alternating
between the two engines.
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from pathlib import Path

from roseinfer.bench.corpus import DEFAULT_CORPUS
from roseinfer.bench.prompts import chat_prompt_ids, user_chats
from roseinfer.engine.arg_utils import add_engine_args, engine_args_from_cli

_TASKS = [
    "Correct the spelling and punctuation of this text and write it out again in full:\n\n{}",
    "Rewrite this text in plain modern English, keeping every sentence:\n\n{}",
    "Summarise this text, quoting its key sentences:\n\n{}",
    "Copy this text, adding a short title at the start:\n\n{}",
]
_CODE_TASKS = [
    "Add type hints to this Python code and write it out in full:\n\n{}",
    "Add a comment above each line of this Python code and write it out in full:\n\n{}",
    "Rename the variables of this Python code to clearer names and write it out in full:\n\n{}",
    "Fix any bug in this Python code and write it out in full:\n\n{}",
]


def grounded_prompts(count: int = 32) -> list[str]:
    """Half editing/summarising paragraphs of the corpus, half editing functions of this package."""
    paragraphs = _passages(Path(DEFAULT_CORPUS).read_text())
    from roseinfer.bench import prompts as prompts_module
    from roseinfer.core import spec_decode
    from roseinfer.worker import sampler

    functions = []
    for module in (spec_decode, sampler, prompts_module):
        for _, function in inspect.getmembers(module, inspect.isfunction):
            if function.__module__ == module.__name__:
                source = inspect.getsource(function)
                if 200 < len(source) < 1200:
                    functions.append(source)
    half = count // 2
    texts = [_TASKS[i % len(_TASKS)].format(paragraphs[(i * 7) % len(paragraphs)]) for i in range(half)]
    code = [_CODE_TASKS[i % len(_CODE_TASKS)].format(functions[i % len(functions)]) for i in range(count - half)]
    return texts + code


def _passages(text: str, size: int = 500) -> list[str]:
    """Runs of whole sentences of about `size` characters (the speeches are one line each)."""
    passages, current = [], ""
    for line in text.splitlines():
        if len(line) < 200:  # titles
            continue
        for sentence in line.split(". "):
            current = f"{current}{sentence.strip()}. "
            if len(current) >= size:
                passages.append(current.strip())
                current = ""
    return passages


def run_spec(args: argparse.Namespace) -> int:
    from roseinfer import LLM, SamplingParams

    settings = engine_args_from_cli(args)
    spec_config = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                   "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
    plain = LLM(**settings)
    speculative = LLM(**(settings | {"speculative_config": spec_config}))
    tokenizer = plain.get_tokenizer()
    workloads = {
        "input-grounded": chat_prompt_ids(tokenizer, [[{"role": "user", "content": p}] for p in grounded_prompts(args.num_prompts)]),
        "chat": chat_prompt_ids(tokenizer, user_chats(args.num_prompts)),
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for llm in (plain, speculative):  # warm-up
        llm.generate(prompt_token_ids=workloads["chat"][:1], sampling_params=SamplingParams(max_tokens=8), use_tqdm=False)
    rows = []
    for name, prompts in workloads.items():
        seconds = {"off": 0.0, "ngram": 0.0}
        tokens = {"off": 0, "ngram": 0}
        stats = speculative.llm_engine.engine_core.scheduler.stats
        drafts_before, accepted_before = stats.num_draft_tokens, stats.num_accepted_tokens
        for prompt in prompts:
            outputs = {}
            for mode, llm in (("off", plain), ("ngram", speculative)):
                started = time.perf_counter()
                output = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
                seconds[mode] += time.perf_counter() - started
                outputs[mode] = output.outputs[0].token_ids
                tokens[mode] += len(outputs[mode])
            if outputs["off"] != outputs["ngram"]:
                raise RuntimeError(f"speculation changed a greedy output ({name}): a bug")
        drafts = stats.num_draft_tokens - drafts_before
        accepted = stats.num_accepted_tokens - accepted_before
        rows.append({"workload": name, "prompts": len(prompts), "off_tok_s": tokens["off"] / seconds["off"],
                     "ngram_tok_s": tokens["ngram"] / seconds["ngram"], "drafts": drafts,
                     "acceptance": accepted / drafts if drafts else 0.0})
    print(f"\nspeculative decoding (ngram {json.dumps(spec_config)}), one stream, greedy, "
          f"{args.max_tokens} new tokens at most, outputs checked identical")
    print(f"{'workload':<16}{'prompts':>8}{'off tok/s':>11}{'ngram tok/s':>13}{'speed-up':>10}{'drafts':>8}{'accepted':>10}")
    for row in rows:
        print(f"{row['workload']:<16}{row['prompts']:>8}{row['off_tok_s']:>11.1f}{row['ngram_tok_s']:>13.1f}"
              f"{row['ngram_tok_s'] / row['off_tok_s']:>9.2f}x{row['drafts']:>8}{100 * row['acceptance']:>9.1f}%")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("spec", help="single-stream speed with n-gram speculative decoding vs without")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    add_engine_args(parser)
    parser.set_defaults(handler=run_spec)
