"""`roseinfer generate | serve | pull | export-hf | bench`: the command line."""

from __future__ import annotations

import argparse
import logging
import sys

from roseinfer.engine.arg_utils import add_engine_args, engine_args_from_cli, engine_config_from_cli
from roseinfer.errors import RoseInferError


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
    """Generate for args.prompts through `LLM` and print each as the seed's offline example does."""
    from roseinfer.engine.input_processor import ChatPrompt
    from roseinfer.engine.llm import LLM
    from roseinfer.executor.local_workers import run_worker_host_if_asked
    from roseinfer.sampling_params import SamplingParams
    from roseinfer.seed_api import InferenceEngine

    exit_code = run_worker_host_if_asked(engine_config_from_cli(args))
    if exit_code is not None:
        return exit_code

    prompts = list(args.prompts or [])
    if not prompts and not sys.stdin.isatty():
        prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise RoseInferError("give at least one prompt (as arguments, or one per line on stdin)")
    # The sampling flags are checked before seconds go into loading the model.
    params = SamplingParams.from_seed_args(
        args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.stop_on_eos,
        args.do_sample, args.seed,
    )
    llm = LLM(**engine_args_from_cli(args))
    chat = getattr(args, "chat", False)
    if getattr(args, "stream", False):
        for index, prompt in enumerate(prompts):
            print(f"### request {index}", flush=True)
            request = ChatPrompt([{"role": "user", "content": prompt}]) if chat else prompt
            for piece in InferenceEngine(llm_engine=llm.llm_engine).stream(request, params):  # the seed's streaming
                print(piece, end="", flush=True)
            print("\n")
        return 0
    if chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for index, output in enumerate(outputs):
        print(f"### request {index}")
        print(output.outputs[0].text)
        print()
    return 0


def run_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from roseinfer.models.export import export_gguf_to_hf

    output = export_gguf_to_hf(Path(args.model) if args.model else None, Path(args.output))
    print(f"wrote {output}")
    return 0


def run_pull(args: argparse.Namespace) -> int:
    """Fetch a Hub model into the local cache (huggingface_hub's progress bars on the terminal) and
    print the path it loads from."""
    from roseinfer.models.model_store import parse_model_ref, pull

    ref = parse_model_ref(args.model)
    if ref is None:
        raise RoseInferError(f"{args.model!r} is not a Hub model reference: name it as user/repo[@revision][:QUANT] "
                             "(a local path needs no pull)")
    print(pull(ref, progress=not args.quiet))
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

    pull = commands.add_parser("pull", help="download a model from the Hugging Face Hub into its cache",
                               description="Download user/repo[@revision][:QUANT] (a GGUF repository's file for "
                                           "the quant, Q4_K_M by default, with every shard and its mmproj; a "
                                           "transformers repository's safetensors and tokenizer) into "
                                           "huggingface_hub's cache (HF_HOME, HF_HUB_CACHE, HF_ENDPOINT, HF_TOKEN "
                                           "apply), check each file's checksum, and print its local path.")
    pull.add_argument("model", metavar="user/repo[@revision][:QUANT]")
    pull.add_argument("--quiet", action="store_true", help="no progress bars")
    pull.set_defaults(handler=run_pull)

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
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # `serve -dp N` starts replicas with it
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



# -- the flags reference in docs/api.md, rendered from the parser so that it cannot drift ---------

FLAGS_BEGIN = "<!-- BEGIN GENERATED: roseinfer serve --help -->"
FLAGS_END = "<!-- END GENERATED: roseinfer serve --help -->"


def command_parser(name: str) -> argparse.ArgumentParser:
    """The parser of one subcommand (`serve`, `generate`, ...)."""
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise KeyError(name)


def _cell(text: str, code: bool = False) -> str:
    """One line of a Markdown table cell, taken literally (in a code span when `code`)."""
    text = " ".join(text.split()).replace("|", "\\|")
    return f"`{text}`" if code else text.replace("<", "&lt;").replace("*", "\\*")


def _invocation(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    """A flag's spellings and its argument once (`--model, --checkpoint-path MODEL`), the same on
    every Python (--help's own spelling of several names changed in 3.13)."""
    names = ", ".join(action.option_strings)
    if action.nargs == 0:
        return names
    return f"{names} {formatter._format_args(action, formatter._get_default_metavar_for_optional(action))}"


def flags_markdown(parser: argparse.ArgumentParser) -> str:
    """`parser`'s options as Markdown: one table per argument group, in --help's order, with each
    flag as --help spells it, its default and its help text."""
    formatter = argparse.HelpFormatter(parser.prog)  # plain, whatever the terminal
    sections = []
    for group in parser._action_groups:
        actions = [action for action in group._group_actions if not isinstance(action, argparse._HelpAction)]
        if not actions:
            continue
        rows = [f"**{_cell(group.title or '')}**", "", "| flag | default | what it does |", "|---|---|---|"]
        for action in actions:
            default = action.default
            flag_only = isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction)
            shown = "" if default is None or default is argparse.SUPPRESS or flag_only else _cell(
                repr(default) if default == "" else str(default), code=True)
            help_text = formatter._expand_help(action) if action.help else ""
            rows.append(f"| {_cell(_invocation(formatter, action), code=True)} | {shown} "
                        f"| {_cell(help_text)} |")
        sections.append("\n".join(rows))
    return "\n\n".join(sections) + "\n"


def docs_with_flags(text: str) -> str:
    """`text` (docs/api.md) with the part between the markers replaced by `serve`'s flags table."""
    head, begin, rest = text.partition(FLAGS_BEGIN)
    _, end, tail = rest.partition(FLAGS_END)
    if not begin or not end:
        raise ValueError(f"the markers {FLAGS_BEGIN!r} and {FLAGS_END!r} are missing")
    return f"{head}{FLAGS_BEGIN}\n\n{flags_markdown(command_parser('serve'))}\n{FLAGS_END}{tail}"


def write_docs_flags(path: str = "docs/api.md") -> None:
    """Regenerate docs/api.md's flags table: `python -c 'import roseinfer.cli as c; c.write_docs_flags()'`."""
    with open(path, encoding="utf-8") as file:
        text = file.read()
    with open(path, "w", encoding="utf-8") as file:
        file.write(docs_with_flags(text))


if __name__ == "__main__":
    raise SystemExit(main())
