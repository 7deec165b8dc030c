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
# The output cap of a request that sets none (llama-server's -n): an agent that sends no
# max_tokens (Codex) gets an answer, not a generation until the context or the time limit ends.
DEFAULT_MAX_TOKENS = 4096
# Connections: a slow or stalled client may hold a connection only this long (seconds).
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 60.0
DEFAULT_SEND_TIMEOUT = 60.0
# Open connections (uvicorn answers 503 beyond): each costs a socket and a little memory, and more
# than the engine's queue can hold wait for nothing.
DEFAULT_LIMIT_CONCURRENCY = 1024
API_KEY_ENV = "ROSEINFER_API_KEY"
LOOPBACK_HOSTS = ["localhost", "127.0.0.1", "[::1]"]


def add_server_args(parser: argparse.ArgumentParser) -> None:
    from roseinfer.tool_parsers import TOOL_PARSERS

    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    group.add_argument("--served-model-name", default=None, help="the model name clients use (default: the model's)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but the chat page, /health "
                            f"and /metrics (also read from ${API_KEY_ENV}, or from a file: --api-key-file)")
    group.add_argument("--api-key-file", default=None,
                       help="read the API key from this file (its first line): keeps it out of the process list")
    group.add_argument("--allowed-hosts", default=None,
                       help="comma-separated names the Host header may carry ('*': any); default: "
                            f"{','.join(LOOPBACK_HOSTS)} for a server on a loopback address without an API "
                            "key (DNS rebinding), else any")
    group.add_argument("--protect-metrics", action="store_true",
                       help="with --api-key, require the key on /health and /metrics too")
    group.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help='how the model writes tool calls, for tool_choice "auto" (default: the format its chat '
                            "template writes; none found: auto answers in text); \"required\" and named tool "
                            "choices need none")
    group.add_argument("--allow-pull", action="store_true",
                       help="let clients download models into the Hub cache with Ollama's POST /api/pull (off by "
                            "default: a client could fill the disk); a --model named user/repo[:QUANT] is "
                            "downloaded at startup either way, as llama-server's -hf does")
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
    limits.add_argument("--max-tokens-default", type=int, default=DEFAULT_MAX_TOKENS,
                        help="the most tokens a request that sets no max_tokens generates (default "
                             f"{DEFAULT_MAX_TOKENS}; cut to what fits the context; 0: the whole context)")
    limits.add_argument("--max-stop", type=int, default=DEFAULT_MAX_STOP,
                        help=f"most stop strings, and most stop token ids, per request (default {DEFAULT_MAX_STOP})")
    limits.add_argument("--max-stop-chars", type=int, default=DEFAULT_MAX_STOP_CHARS,
                        help=f"longest stop string in characters (default {DEFAULT_MAX_STOP_CHARS})")
    limits.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT,
                        help="seconds a request may run from arrival to its last token before it is aborted "
                             f"with a 408 (or an error event); 0 for none (default {DEFAULT_REQUEST_TIMEOUT:g})")
    connections = parser.add_argument_group("connections (deadlines for slow or stalled clients)")
    connections.add_argument("--limit-concurrency", type=int, default=DEFAULT_LIMIT_CONCURRENCY,
                             help=f"most open connections; 503 beyond (default {DEFAULT_LIMIT_CONCURRENCY})")
    connections.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT,
                             help="seconds a request's headers may take to arrive; 0 for none "
                                  f"(default {DEFAULT_HEADER_TIMEOUT:g})")
    connections.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT,
                             help="seconds a request's body may take to arrive (408 after); 0 for none "
                                  f"(default {DEFAULT_BODY_TIMEOUT:g})")
    connections.add_argument("--send-timeout", type=float, default=DEFAULT_SEND_TIMEOUT,
                             help="seconds a client may read nothing of a response before the connection is "
                                  f"closed and its request aborted; 0 for none (default {DEFAULT_SEND_TIMEOUT:g})")
    from roseinfer.server import response_store

    store = parser.add_argument_group("Responses API store (what store: true keeps for GET /v1/responses/{id} "
                                      "and previous_response_id; in memory, oldest dropped first)")
    store.add_argument("--responses-store-max-entries", type=int, default=response_store.DEFAULT_MAX_ENTRIES,
                       help=f"most responses kept; 0 keeps none (default {response_store.DEFAULT_MAX_ENTRIES})")
    store.add_argument("--responses-store-max-bytes", type=int, default=response_store.DEFAULT_MAX_BYTES,
                       help="most bytes of JSON kept over all responses (default "
                            f"{response_store.DEFAULT_MAX_BYTES})")
    store.add_argument("--responses-store-ttl", type=float, default=response_store.DEFAULT_TTL_SECONDS,
                       help=f"seconds a response is kept (default {response_store.DEFAULT_TTL_SECONDS:g})")
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


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key, --api-key-file or $ROSEINFER_API_KEY (one of them at most); an empty
    key is an error, not a server open to all."""
    import os

    from roseinfer.errors import RoseInferError

    sources = {name: value for name, value in (
        ("--api-key", args.api_key),
        ("--api-key-file", args.api_key_file),
        (f"${API_KEY_ENV}", os.environ.get(API_KEY_ENV)),
    ) if value is not None}
    if len(sources) > 1:
        raise RoseInferError(f"the API key is given by {' and '.join(sources)}: give it one way")
    if not sources:
        return None
    (source, value), = sources.items()
    if source == "--api-key-file":
        try:
            lines = open(value, encoding="utf-8").read().splitlines()
        except OSError as exc:
            raise RoseInferError(f"--api-key-file: cannot read {value}: {exc.strerror}") from None
        value = lines[0].strip() if lines else ""
    if not value.strip():
        raise RoseInferError(f"the API key from {source} is empty: a server that takes any key is a server "
                             "without one (leave it out for that)")
    return value


def allowed_hosts(args: argparse.Namespace, api_key: str | None) -> list[str] | None:
    """The Host header names to answer (None: any)."""
    if args.allowed_hosts is not None:
        names = [name.strip() for name in args.allowed_hosts.split(",") if name.strip()]
        if not names:
            from roseinfer.errors import RoseInferError

            raise RoseInferError("--allowed-hosts is empty: give names, or '*' for any")
        return None if "*" in names else names
    return LOOPBACK_HOSTS if api_key is None and is_loopback(args.host) else None


def is_loopback(host: str) -> bool:
    """Whether `--host` listens on this machine's loopback interface only."""
    return host in ("localhost", "::1") or host.startswith("127.")


def run_server(args: argparse.Namespace) -> int:
    import uvicorn

    from roseinfer.engine.arg_utils import engine_config_from_cli
    from roseinfer.engine.async_llm import AsyncLLM
    from roseinfer.engine.input_processor import RequestLimits, longest_prompt_chars
    from roseinfer.engine.stats import LoggingStatLogger
    from roseinfer.errors import RoseInferError
    from roseinfer.executor.local_workers import run_worker_host_if_asked
    from roseinfer.server.app import create_app
    from roseinfer.server.connections import guarded_protocol
    from roseinfer.server.metrics import PrometheusStatLogger

    if args.data_parallel_size > 1:
        from roseinfer.server.data_parallel import run_data_parallel

        return run_data_parallel(args, getattr(args, "argv", sys.argv[1:]))
    exit_code = run_worker_host_if_asked(engine_config_from_cli(args))
    if exit_code is not None:  # a host without the engine: only its tensor-parallel workers ran
        return exit_code
    for flag in ("max_queue_len", "max_request_body_bytes", "max_prompt_chars", "max_stop", "max_stop_chars",
                 "limit_concurrency"):
        _check_positive("--" + flag.replace("_", "-"), getattr(args, flag))
    for flag in ("request_timeout", "header_timeout", "body_timeout", "send_timeout", "max_tokens_default"):
        if getattr(args, flag) < 0:
            raise RoseInferError(f"--{flag.replace('_', '-')} must be >= 0 (0: no limit), got {getattr(args, flag)}")
    api_key = resolve_api_key(args)
    hosts = allowed_hosts(args, api_key)
    from roseinfer.server.response_store import ResponseStore

    if args.responses_store_max_entries < 0 or args.responses_store_max_bytes < 0 or args.responses_store_ttl <= 0:
        raise RoseInferError("--responses-store-max-entries and --responses-store-max-bytes must be >= 0, "
                             "--responses-store-ttl > 0")
    store = ResponseStore(args.responses_store_max_entries, args.responses_store_max_bytes, args.responses_store_ttl)
    config = engine_config_from_cli(args)
    config.served_model_name = args.served_model_name
    max_queue_len = args.max_queue_len or 2 * config.max_num_seqs
    engine = AsyncLLM(config, engine_core=args.engine_core, max_queue_len=max_queue_len,
                      request_timeout=args.request_timeout or None,
                      stat_loggers=[LoggingStatLogger(args.stats_interval)])
    engine.input_processor.limits = RequestLimits(
        max_prompt_chars=args.max_prompt_chars or longest_prompt_chars(engine.tokenizer, engine.max_model_len),
        max_stop=args.max_stop, max_stop_chars=args.max_stop_chars,
        default_max_tokens=args.max_tokens_default or None,
    )
    metrics = PrometheusStatLogger(
        engine.model_name, lambda: engine.scheduler_stats, lambda: engine.num_waiting,
        cache_config={"block_size": engine.config.block_size, "num_gpu_blocks": engine.config.num_kv_blocks},
    )
    engine.stat_loggers.append(metrics)
    app = create_app(engine, metrics, args.served_model_name, api_key, enable_web_ui=not args.disable_web_ui,
                     tool_call_parser=args.tool_call_parser, max_body_bytes=args.max_request_body_bytes,
                     protect_metrics=args.protect_metrics, body_timeout=args.body_timeout or None,
                     allowed_hosts=hosts, response_store=store, allow_pull=args.allow_pull)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning", access_log=False,
        timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_FLUSH_SECONDS,
        # h11 with the header and send deadlines; no WebSocket (or other) upgrade is ever accepted
        http=guarded_protocol(args.header_timeout, args.send_timeout), ws="none",
        limit_concurrency=args.limit_concurrency,
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
