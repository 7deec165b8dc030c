"""`roseinfer bench ...`: benchmarks that print ratios against a peer measured in the same run."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> None:
    from roseinfer.bench import (
        compare,
        gguf_files,
        offline,
        prefix_cache,
        quality,
        scale,
        serve,
        single_stream,
        spec_decode,
        structured,
    )

    bench = commands.add_parser("bench", help="benchmarks (offline throughput, ...)")
    kinds = bench.add_subparsers(dest="bench", required=True)
    offline.add_parser(kinds)
    quality.add_parser(kinds)
    serve.add_parser(kinds)
    prefix_cache.add_parser(kinds)
    compare.add_parser(kinds)
    scale.add_parser(kinds)
    structured.add_parser(kinds)
    spec_decode.add_parser(kinds)
    single_stream.add_parser(kinds)
    gguf_files.add_parser(kinds)
