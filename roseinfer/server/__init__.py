"""The OpenAI-compatible HTTP server: `roseinfer serve` (or the seed's `python -m roseinfer.server`)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
from collections.abc import Iterator

logger = logging.getLogger("roseinfer.server")

# Measured on a 2-core CPU machine (see README "How a request flows"): the engine core in a thread.
DEFAULT_ENGINE_CORE = "thread"


def add_server_args(parser: argparse.ArgumentParser) -> None:
    from roseinfer.tool_parsers import TOOL_PARSERS

    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    group.add_argument("--served-model-name", default=None, help="the model name clients use (default: the model's)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 routes (/health stays open)")
    group.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help='how the model writes tool calls, for tool_choice "auto" (hermes: Qwen2.5/Qwen3\'s '
                            '<tool_call> JSON; llama3_json: Llama 3\'s JSON); "required" and named tool choices '
                            "need none")
    group.add_argument("--disable-web-ui", action="store_true",
                       help="do not serve the chat page at / (it is on by default)")
    group.add_argument("--max-queue-len", type=int, default=None,
                       help="answer 503 at once when this many requests are already waiting")
    group.add_argument("--stats-interval", type=float, default=10.0, help="seconds between throughput log lines")
    group.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="on SIGINT/SIGTERM, seconds to let in-flight requests finish before aborting them")
    group.add_argument("--engine-core", choices=("thread", "process"), default=DEFAULT_ENGINE_CORE,
                       help="run the engine core in a background thread of the server process, or in a "
                            f"process of its own (ZeroMQ + msgpack) (default: {DEFAULT_ENGINE_CORE})")
    from roseinfer.server.data_parallel import add_data_parallel_args

    add_data_parallel_args(parser)


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but a SIGINT/SIGTERM ends in a normal exit (status 0) after the
        graceful shutdown, where uvicorn re-raises the signal once it is done."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server


def run_server(args: argparse.Namespace) -> int:
    import uvicorn

    from roseinfer.config import EngineConfig
    from roseinfer.engine.async_llm import AsyncLLM
    from roseinfer.engine.stats import LoggingStatLogger
    from roseinfer.errors import RoseInferError
    from roseinfer.executor.local_workers import run_worker_host_if_asked
    from roseinfer.server.app import create_app
    from roseinfer.server.metrics import PrometheusStatLogger

    if args.data_parallel_size > 1:
        from roseinfer.server.data_parallel import run_data_parallel

        return run_data_parallel(args, getattr(args, "argv", sys.argv[1:]))
    exit_code = run_worker_host_if_asked(EngineConfig.from_cli_args(args))
    if exit_code is not None:  # a host without the engine: only its tensor-parallel workers ran
        return exit_code
    if args.max_queue_len is not None and args.max_queue_len < 1:
        raise RoseInferError(f"--max-queue-len must be at least 1, got {args.max_queue_len}")
    config = EngineConfig.from_cli_args(args)
    config.served_model_name = args.served_model_name
    engine = AsyncLLM(config, engine_core=args.engine_core, max_queue_len=args.max_queue_len,
                      stat_loggers=[LoggingStatLogger(args.stats_interval)])
    metrics = PrometheusStatLogger(
        engine.model_name, lambda: engine.scheduler_stats, lambda: engine.num_waiting,
        cache_config={"block_size": engine.config.block_size, "num_gpu_blocks": engine.config.num_kv_blocks},
    )
    engine.stat_loggers.append(metrics)
    app = create_app(engine, metrics, args.served_model_name, args.api_key, enable_web_ui=not args.disable_web_ui,
                     tool_call_parser=args.tool_call_parser)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning", access_log=False,
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    server = _server_class()(config)
    logger.info("listening on http://%s:%d (OpenAI API under /v1)", args.host, args.port)
    try:
        server.run()  # returns after SIGINT/SIGTERM: stops accepting, drains, then the engine stops
    finally:
        engine.shutdown()
    return 0
