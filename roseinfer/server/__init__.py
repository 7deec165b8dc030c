"""The OpenAI-compatible HTTP server: `roseinfer serve` (or the seed's `python -m roseinfer.server`)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Callable, Iterator

logger = logging.getLogger("roseinfer.server")

# Measured on a 2-core CPU machine (see README "How a request flows"): the engine core in a thread.
DEFAULT_ENGINE_CORE = "thread"


# Seconds uvicorn waits past --shutdown-timeout for the requests ended then to send their last bytes.
SHUTDOWN_FLUSH_SECONDS = 5.0
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_REQUEST_TIMEOUT = 600.0
DEFAULT_MAX_STOP = 32
DEFAULT_MAX_STOP_CHARS = 512


def add_server_args(parser: argparse.ArgumentParser) -> None:
    from roseinfer.tool_parsers import TOOL_PARSERS

    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    group.add_argument("--served-model-name", default=None, help="the model name clients use (default: the model's)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but the chat page, /health "
                            "and /metrics")
    group.add_argument("--protect-metrics", action="store_true",
                       help="with --api-key, require the key on /health and /metrics too")
    group.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help='how the model writes tool calls, for tool_choice "auto" (hermes: Qwen2.5/Qwen3\'s '
                            '<tool_call> JSON; llama3_json: Llama 3\'s JSON); "required" and named tool choices '
                            "need none")
    group.add_argument("--disable-web-ui", action="store_true",
                       help="do not serve the chat page at / (it is on by default)")
    group.add_argument("--max-queue-len", type=int, default=None,
                       help="answer 503 (with Retry-After) at once when this many sequences are already "
                            "waiting (default: twice --max-num-seqs)")
    group.add_argument("--stats-interval", type=float, default=10.0, help="seconds between throughput log lines")
    group.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="on SIGINT/SIGTERM, seconds to let in-flight requests finish before ending them "
                            "with an error (default 10)")
    group.add_argument("--engine-core", choices=("thread", "process"), default=DEFAULT_ENGINE_CORE,
                       help="run the engine core in a background thread of the server process, or in a "
                            f"process of its own (ZeroMQ + msgpack) (default: {DEFAULT_ENGINE_CORE})")
    limits = parser.add_argument_group("request limits (each violation is a 4xx naming the limit)")
    limits.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help=f"largest request body, 413 beyond (default {DEFAULT_MAX_BODY_BYTES})")
    limits.add_argument("--max-prompt-chars", type=int, default=None,
                        help="longest prompt in characters, checked before tokenizing (default: the context "
                             "times the longest token, which lets every prompt that could fit through)")
    limits.add_argument("--max-stop", type=int, default=DEFAULT_MAX_STOP,
                        help=f"most stop strings, and most stop token ids, per request (default {DEFAULT_MAX_STOP})")
    limits.add_argument("--max-stop-chars", type=int, default=DEFAULT_MAX_STOP_CHARS,
                        help=f"longest stop string in characters (default {DEFAULT_MAX_STOP_CHARS})")
    limits.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT,
                        help="seconds a request may run from arrival to its last token before it is aborted "
                             f"with a 408 (or an error event); 0 for none (default {DEFAULT_REQUEST_TIMEOUT:g})")
    from roseinfer.server.data_parallel import add_data_parallel_args

    add_data_parallel_args(parser)


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but a SIGINT/SIGTERM ends in a normal exit (status 0) after the
        graceful shutdown, where uvicorn re-raises the signal once it is done; and the app hears of
        the shutdown first (`before_shutdown`), so that it can refuse new requests and end the
        ones still running at the timeout with an error instead of cutting them off."""

        before_shutdown: Callable[[], None] | None = None

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            if self.before_shutdown is not None:
                self.before_shutdown()
            await super().shutdown(sockets)

    return Server


def _check_positive(name: str, value: float | None) -> None:
    if value is not None and value < 1:
        from roseinfer.errors import RoseInferError

        raise RoseInferError(f"{name} must be at least 1, got {value}")


def run_server(args: argparse.Namespace) -> int:
    import uvicorn

    from roseinfer.config import EngineConfig
    from roseinfer.engine.async_llm import AsyncLLM
    from roseinfer.engine.stats import LoggingStatLogger
    from roseinfer.errors import RoseInferError
    from roseinfer.executor.local_workers import run_worker_host_if_asked
    from roseinfer.input_processor import RequestLimits, longest_prompt_chars
    from roseinfer.server.app import create_app
    from roseinfer.server.metrics import PrometheusStatLogger

    if args.data_parallel_size > 1:
        from roseinfer.server.data_parallel import run_data_parallel

        return run_data_parallel(args, getattr(args, "argv", sys.argv[1:]))
    exit_code = run_worker_host_if_asked(EngineConfig.from_cli_args(args))
    if exit_code is not None:  # a host without the engine: only its tensor-parallel workers ran
        return exit_code
    for flag in ("max_queue_len", "max_request_body_bytes", "max_prompt_chars", "max_stop", "max_stop_chars"):
        _check_positive("--" + flag.replace("_", "-"), getattr(args, flag))
    if args.request_timeout < 0:
        raise RoseInferError(f"--request-timeout must be >= 0 (0: no limit), got {args.request_timeout}")
    config = EngineConfig.from_cli_args(args)
    config.served_model_name = args.served_model_name
    max_queue_len = args.max_queue_len or 2 * config.max_num_seqs
    engine = AsyncLLM(config, engine_core=args.engine_core, max_queue_len=max_queue_len,
                      request_timeout=args.request_timeout or None,
                      stat_loggers=[LoggingStatLogger(args.stats_interval)])
    engine.input_processor.limits = RequestLimits(
        max_prompt_chars=args.max_prompt_chars or longest_prompt_chars(engine.tokenizer, engine.max_model_len),
        max_stop=args.max_stop, max_stop_chars=args.max_stop_chars,
    )
    metrics = PrometheusStatLogger(
        engine.model_name, lambda: engine.scheduler_stats, lambda: engine.num_waiting,
        cache_config={"block_size": engine.config.block_size, "num_gpu_blocks": engine.config.num_kv_blocks},
    )
    engine.stat_loggers.append(metrics)
    app = create_app(engine, metrics, args.served_model_name, args.api_key, enable_web_ui=not args.disable_web_ui,
                     tool_call_parser=args.tool_call_parser, max_body_bytes=args.max_request_body_bytes,
                     protect_metrics=args.protect_metrics)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning", access_log=False,
        timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_FLUSH_SECONDS,
    )
    server = _server_class()(config)
    server.before_shutdown = lambda: app.state.begin_shutdown(args.shutdown_timeout)
    limits = engine.input_processor.limits
    logger.info("limits: body %d bytes, prompt %d characters, %d stop entries of %d characters, %s per "
                "request, %d sequences waiting", args.max_request_body_bytes, limits.max_prompt_chars,
                limits.max_stop, limits.max_stop_chars,
                f"{args.request_timeout:g} s" if args.request_timeout else "no time limit", max_queue_len)
    logger.info("listening on http://%s:%d (OpenAI API under /v1)", args.host, args.port)
    try:
        server.run()  # returns after SIGINT/SIGTERM: stops accepting, drains, then the engine stops
    finally:
        engine.shutdown()
    return 0
