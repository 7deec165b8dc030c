"""The seed's offline example: `python -m roseinfer.offline_example --prompts "Hi" "Hello"`.

Takes the seed's flags (--checkpoint-path, --tokenizer-name, --device, --bf16, --no-amp, ...);
--checkpoint-path may be omitted for the default model.
"""

from __future__ import annotations

import argparse
import logging
import sys

from roseinfer.cli import add_seed_sampling_args, run_generate
from roseinfer.engine.arg_utils import add_engine_args
from roseinfer.errors import RoseInferError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Generate text from a model in batch mode")
    parser.add_argument("--prompts", nargs="+", required=True, help="prompts to generate from")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    parser.add_argument("--stream", action="store_true", help="stream the output")
    parser.add_argument("--no-amp", action="store_true", help="run in float32 (the CPU default)")
    parser.add_argument("--bf16", action="store_true", help="run in bfloat16")
    add_seed_sampling_args(parser)
    add_engine_args(parser)
    args = parser.parse_args(argv)
    if args.bf16:
        args.dtype = "bfloat16"
    elif args.no_amp:
        args.dtype = "float32"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        return run_generate(args)
    except RoseInferError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
