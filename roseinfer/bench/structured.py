"""`roseinfer bench structured`: what grammar constraints cost, measured in one run.

16 streams constrained to JSON schemas (each a different schema, output long enough to measure
decoding) against 16 unconstrained streams of the same prompts and the same number of new tokens,
offline (`LLM.generate`), alternated and repeated. Reports decode throughput of each, the
constrained/unconstrained ratio, the bitmask fill time per step, and the cold compile time of the
largest schema.
"""

from __future__ import annotations

import argparse
import json
import time

from roseinfer.bench.prompts import chat_prompt_ids
from roseinfer.engine.arg_utils import add_engine_args, engine_args_from_cli


def schemas(count: int) -> list[dict]:
    """`count` different schemas of long, bounded outputs: arrays of small records."""
    shapes = [
        {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
        {"city": {"type": "string", "maxLength": 16}, "country": {"type": "string", "maxLength": 16}},
        {"title": {"type": "string", "maxLength": 24}, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}},
        {"word": {"type": "string", "pattern": "^[a-z]{2,10}$"}, "ok": {"type": "boolean"}},
    ]
    result = []
    for i in range(count):
        properties = shapes[i % len(shapes)]
        item = {"type": "object", "properties": properties, "required": list(properties),
                "additionalProperties": False}
        items = 12 + i // len(shapes)  # differ by length too, so no two schemas are the same
        result.append({"type": "object", "properties": {"items": {
            "type": "array", "items": item, "minItems": items, "maxItems": items}},
            "required": ["items"], "additionalProperties": False})
    return result


def run_structured(args: argparse.Namespace) -> int:
    from roseinfer import LLM, SamplingParams
    from roseinfer.structured_output import GrammarCompiler, StructuredOutputsParams

    llm = LLM(**engine_args_from_cli(args))
    tokenizer = llm.get_tokenizer()
    chats = [[{"role": "user", "content": f"List {12 + i // 4} records as JSON, please."}] for i in range(args.streams)]
    prompts = chat_prompt_ids(tokenizer, chats)
    constraints = [StructuredOutputsParams(json=schema) for schema in schemas(args.streams)]
    manager = llm.llm_engine.engine_core.structured_output_manager

    def constrained() -> tuple[int, float]:
        params = [SamplingParams(temperature=0.7, seed=i, max_tokens=args.max_tokens, structured_outputs=c)
                  for i, c in enumerate(constraints)]
        started = time.perf_counter()
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        for output in outputs:
            json.loads(output.outputs[0].text)  # a benchmark of wrong outputs would mean nothing
        return [len(o.outputs[0].token_ids) for o in outputs], elapsed

    def free(lengths: list[int]) -> tuple[int, float]:
        params = [SamplingParams(temperature=0.7, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
        started = time.perf_counter()
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outputs], time.perf_counter() - started

    constrained()  # warm-up: compiles the grammars (cached) and the kernels
    rows = []
    for repeat in range(args.repeats):
        mask_before = (manager.mask_seconds, manager.mask_steps)
        lengths, seconds = constrained()
        mask_seconds = manager.mask_seconds - mask_before[0]
        mask_steps = manager.mask_steps - mask_before[1]
        free_lengths, free_seconds = free(lengths)
        rows.append((repeat, sum(lengths) / seconds, sum(free_lengths) / free_seconds,
                     1000 * mask_seconds / max(mask_steps, 1)))

    largest = max(constraints, key=lambda c: len(c.grammar_text))
    cold = GrammarCompiler(tokenizer, vocab_size=llm.llm_engine.model_config.vocab_size)
    started = time.perf_counter()
    cold.compile(largest)
    compile_ms = 1000 * (time.perf_counter() - started)
    cold.shutdown()

    print(f"\nstructured outputs: {args.streams} streams, JSON schemas vs unconstrained, same prompts and lengths")
    print(f"{'repeat':<8}{'constrained tok/s':>19}{'free tok/s':>12}{'ratio':>8}{'mask fill ms/step':>19}")
    for repeat, with_grammar, without, mask_ms in rows:
        print(f"{repeat:<8}{with_grammar:>19.1f}{without:>12.1f}{with_grammar / without:>8.3f}{mask_ms:>19.2f}")
    print(f"cold compile of the largest schema ({len(largest.grammar_text)} characters of grammar): {compile_ms:.1f} ms")
    return 0


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("structured", help="the cost of grammar-constrained decoding")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=600, help="room for the longest JSON output")
    parser.add_argument("--repeats", type=int, default=2)
    add_engine_args(parser)
    parser.set_defaults(handler=run_structured)
