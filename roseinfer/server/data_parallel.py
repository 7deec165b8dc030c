"""`roseinfer serve --data-parallel-size N`: N independent replicas behind a load balancer, on one
machine.

Each replica is an ordinary `roseinfer serve` on its own port of 127.0.0.1, pinned to its share
of this process's cores (tensor-parallel workers inside a replica split that share again); the
router in front of them, on a private port of 127.0.0.1 behind roseinfer's gateway (server/gateway.py:
the key, Host and connection checks, and only the serving routes), is vLLM's Rust load balancer (`vllm-router`, a PyPI package): round robin,
power-of-two least load (it polls each replica's `/get_load`), or prefix-cache aware. It retries
a request that a replica refused and stops sending to a replica that fails its health checks.
On several machines the same router is pointed at replicas on other hosts (README, "Scaling").

The launcher forwards SIGINT/SIGTERM (router first, then the replicas), and exits when the
router or every replica has gone.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from roseinfer.distributed.cpu_binding import plan_cpu_binding
from roseinfer.errors import RoseInferError

logger = logging.getLogger("roseinfer.server")

# The routers it can start (PyPI packages; vllm-router is a dependency, sglang-router optional).
# Both are Rust load balancers of the same lineage; vllm-router is the default: it needs nothing of a
# request that the OpenAI API leaves optional (sglang-router 0.3 refuses a completion without
# `model`) and it measured level or ahead at 64 streams (README, "Scaling").
ROUTERS = ("vllm-router", "sglang-router")
_ROUTER_SUBCOMMAND = {"vllm-router": [], "sglang-router": ["launch"]}
ROUTER_POLICIES = ("power_of_two", "round_robin", "cache_aware", "consistent_hash", "random")
DEFAULT_ROUTER_POLICY = "power_of_two"
# The launcher's own flags, and the key's: replicas get the key in their environment, never on a
# command line that every local user can read in the process list.
_LAUNCHER_FLAGS = ("--data-parallel-size", "--data-parallel-base-port", "--router", "--router-policy",
                   "--router-args", "--port", "--host", "--api-key", "--api-key-file", "--allowed-hosts")
# Switches (no value) that are the gateway's alone: the router's health checks of the replicas
# carry no key, so only the gateway closes /health and /metrics.
_LAUNCHER_SWITCHES = ("--protect-metrics",)
STARTUP_TIMEOUT_S = 600.0


def add_data_parallel_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data parallelism (replicas behind a router)")
    group.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                       help="serve N replicas, each on its share of the cores, behind a router on "
                            "--host:--port (default 1: no router)")
    group.add_argument("--data-parallel-base-port", type=int, default=None,
                       help="the replicas listen on 127.0.0.1, ports BASE .. BASE+N-1 (default: --port + 1; "
                            "0: any free ports)")
    group.add_argument("--router", choices=ROUTERS, default=ROUTERS[0], help="the load balancer (a PyPI package)")
    group.add_argument("--router-policy", choices=ROUTER_POLICIES, default=DEFAULT_ROUTER_POLICY,
                       help=f"how the router picks a replica (default {DEFAULT_ROUTER_POLICY}: the less "
                            "loaded of two, by each replica's /get_load)")
    group.add_argument("--router-args", default="", help="more flags for the router, as one string")


def replica_arguments(argv: list[str]) -> list[str]:
    """The command line of `roseinfer serve ...` without the launcher's own flags."""
    strip = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in _LAUNCHER_FLAGS:
        strip.add_argument(flag)
    for switch in _LAUNCHER_SWITCHES:
        strip.add_argument(switch, action="store_true")
    strip.add_argument("-dp", dest="dp_short")
    _, rest = strip.parse_known_args(argv)
    return rest


def router_executable(name: str) -> str:
    """The router's console script: beside this Python's, or on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise RoseInferError(f"--data-parallel-size needs the {name} load balancer: pip install {name}")
    return found


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class DataParallelLauncher:
    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        if args.data_parallel_size < 2:
            raise RoseInferError(f"--data-parallel-size must be at least 2 here, got {args.data_parallel_size}")
        self.args = args
        self.size = args.data_parallel_size
        base = args.port + 1 if args.data_parallel_base_port is None else args.data_parallel_base_port
        self.ports = [free_port() for _ in range(self.size)] if base == 0 else [base + i for i in range(self.size)]
        if args.port in self.ports:
            raise RoseInferError(f"the router's port {args.port} is one of the replicas' ports {self.ports}")
        self.command = [sys.executable, "-m", "roseinfer.cli", *replica_arguments(argv)]
        from roseinfer.server import API_KEY_ENV, is_loopback, resolve_api_key

        self.api_key = resolve_api_key(args)
        if self.api_key is None and not is_loopback(args.host):
            # A keyless data-parallel deployment on a network address: whoever reaches it drives
            # every replica (issue: the router shape must not be open by default).
            raise RoseInferError(
                f"--data-parallel-size on --host {args.host} needs an API key (--api-key, --api-key-file or "
                f"${API_KEY_ENV}): without one anyone who reaches it uses every replica; or listen on 127.0.0.1"
            )
        self.replica_env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
        if self.api_key is not None:
            self.replica_env[API_KEY_ENV] = self.api_key
        self.auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.router_port = free_port()  # private: only the gateway (server/gateway.py) faces clients
        self.cores = plan_cpu_binding("auto", self.size)
        self.router_binary = router_executable(args.router)
        self.replicas: list[subprocess.Popen] = []
        self.router: subprocess.Popen | None = None
        self.stopping = False

    def start_replicas(self) -> None:
        for index, (port, cores) in enumerate(zip(self.ports, self.cores, strict=True)):
            command = [*self.command, "--host", "127.0.0.1", "--port", str(port)]
            self.replicas.append(subprocess.Popen(
                command, env=self.replica_env,
                preexec_fn=(lambda c=cores: os.sched_setaffinity(0, c)),  # no threads here yet
            ))
            logger.info("replica %d: http://127.0.0.1:%d, cores %s, pid %d", index, port, cores, self.replicas[-1].pid)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        waiting = set(range(self.size))
        while waiting and not self.stopping:
            for index in list(waiting):
                if self.replicas[index].poll() is not None:
                    raise RoseInferError(f"replica {index} exited while starting (code {self.replicas[index].returncode})")
                try:
                    url = f"http://127.0.0.1:{self.ports[index]}/health"  # the key: --protect-metrics
                    if httpx.get(url, headers=self.auth, timeout=2).status_code == 200:
                        waiting.discard(index)
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                raise RoseInferError(f"replica(s) {sorted(waiting)} did not start in {STARTUP_TIMEOUT_S:.0f} s")
            if waiting:
                time.sleep(0.5)

    def start_router(self) -> None:
        args = self.args
        command = [
            self.router_binary, *_ROUTER_SUBCOMMAND[args.router], "--host", "127.0.0.1",
            "--port", str(self.router_port),
            "--worker-urls", *[f"http://127.0.0.1:{port}" for port in self.ports],
            "--max-payload-size", str(args.max_request_body_bytes),
            "--policy", args.router_policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            # Notice a dead replica within seconds rather than minutes; its circuit breaker opens
            # on failed requests meanwhile, and refused requests are retried on another replica.
            "--health-check-interval-secs", "2", "--health-failure-threshold", "2",
            *args.router_args.split(),
        ]
        self.router = subprocess.Popen(command, stdout=subprocess.DEVNULL if args.log_level.upper() != "DEBUG" else None)
        deadline = time.monotonic() + 60
        while True:
            if self.router.poll() is not None:
                raise RoseInferError(f"{args.router} exited while starting (code {self.router.returncode})")
            try:
                if httpx.get(f"{self.router_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RoseInferError(f"{args.router} did not answer on port {self.router_port} in 60 s")
            time.sleep(0.3)
        logger.info("%s (%s) on %s in front of %d replicas", args.router, args.router_policy, self.router_url,
                    self.size)

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def watch(self) -> int:
        """Until stopped, or until the router or every replica has gone."""
        reported: set[int] = set()
        while not self.stopping:
            if self.router.poll() is not None:
                logger.error("the router exited (code %s)", self.router.returncode)
                return 1
            for index, replica in enumerate(self.replicas):
                if replica.poll() is not None and index not in reported:
                    reported.add(index)
                    logger.error("replica %d exited (code %s); the router sends its requests elsewhere",
                                 index, replica.returncode)
            if len(reported) == self.size:
                logger.error("every replica has exited")
                return 1
            time.sleep(0.5)
        return 0

    def stop(self, timeout: float = 30.0) -> None:
        self.stopping = True
        for process in ([self.router] if self.router else []) + self.replicas:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for process in ([self.router] if self.router else []) + self.replicas:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def run_data_parallel(args: argparse.Namespace, argv: list[str]) -> int:
    import threading

    import uvicorn

    from roseinfer.server import _server_class, allowed_hosts
    from roseinfer.server.connections import guarded_protocol
    from roseinfer.server.gateway import create_gateway

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health check
    launcher = DataParallelLauncher(args, argv)

    def stop(_signum: int, _frame: object) -> None:
        launcher.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        launcher.start_replicas()
        launcher.start_router()
        if launcher.stopping:
            return 0
        gateway = create_gateway(launcher.router_url, launcher.api_key, max_body_bytes=args.max_request_body_bytes,
                                 body_timeout=args.body_timeout or None,
                                 allowed_hosts=allowed_hosts(args, launcher.api_key),
                                 protect_metrics=args.protect_metrics)
        server = _server_class()(uvicorn.Config(
            gateway, host=args.host, port=args.port, log_level="warning", access_log=False,
            http=guarded_protocol(args.header_timeout, args.send_timeout), ws="none",
            limit_concurrency=args.limit_concurrency, timeout_graceful_shutdown=args.shutdown_timeout,
        ))
        exit_code = 0

        def watch() -> None:  # the router or every replica gone: the gateway stops too
            nonlocal exit_code
            exit_code = launcher.watch()
            server.should_exit = True

        watcher = threading.Thread(target=watch, name="data-parallel-watch", daemon=True)
        watcher.start()
        logger.info("listening on http://%s:%d (%d replicas behind %s)", args.host, args.port, launcher.size,
                    args.router)
        server.run()  # until SIGINT/SIGTERM (uvicorn's handlers) or the watcher's stop
        launcher.stopping = True
        watcher.join()
        return exit_code
    finally:
        launcher.stop()

