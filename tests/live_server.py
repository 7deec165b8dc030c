"""A real `roseinfer serve` process on a free port of 127.0.0.1, for end-to-end tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    def __init__(self, *flags: str, env: dict[str, str] | None = None, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = f"/tmp/roseinfer-test-server-{self.port}-{time.time_ns()}.log"  # a restart: a new log
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "roseinfer.cli", "serve", "--port", str(self.port), "--stats-interval", "2",
             *flags],
            stdout=self.log, stderr=subprocess.STDOUT, env=os.environ | {"PYTHONUNBUFFERED": "1"} | (env or {}),
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.close()
                raise RuntimeError(f"the server exited: {self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code in (200, 401):  # 401: --protect-metrics
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        self.process.kill()  # no server left behind by a failed start
        self.process.wait()
        self.log.close()
        raise RuntimeError(f"the server did not start in 180 s: {self.output()}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path) as handle:
            return handle.read()

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=60)
        finally:
            self.log.close()


def metric(server: ServerProcess, name: str, headers: dict[str, str] | None = None) -> float:
    text = httpx.get(server.url + "/metrics", headers=headers).text
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))
