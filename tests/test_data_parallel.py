"""Data parallelism: `roseinfer serve --data-parallel-size 2` starts two replicas behind
vllm-router (a real one, from PyPI), driven with the official openai client. Every request is
answered, both replicas serve some (their own /metrics counters say so), the greedy outputs are
those of one replica alone; when a replica is killed mid-run, the requests sent after it are
all answered by the other. Each replica also exposes the metrics the Gateway API Inference
Extension reads, under the names its endpoint picker expects by default."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from live_server import ServerProcess
from support import tiny_hf_model

from roseinfer.server.data_parallel import replica_arguments

PROMPTS = [f"Request number {i}: the quick brown fox" for i in range(64)]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dp") / "llama"
    tiny_hf_model("llama", path)
    return path


def replica_urls(launcher_pid: int) -> dict[int, str]:
    """pid -> URL of each replica the launcher started (from /proc)."""
    children = []
    for task in Path(f"/proc/{launcher_pid}/task").iterdir():
        children += [int(pid) for pid in (task / "children").read_text().split()]
    replicas = {}
    for pid in children:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        if "roseinfer.cli" in argv:
            replicas[pid] = f"http://127.0.0.1:{argv[argv.index('--port', argv.index('serve')) + 1]}"
    return replicas


def complete(client: openai.OpenAI, prompt: str, max_tokens: int = 8) -> str:
    reply = client.completions.create(model="llama", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True})
    return reply.choices[0].text


def successes(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("roseinfer:request_success_total{"))


def test_launcher_strips_its_own_flags():
    argv = ["--log-level", "INFO", "serve", "--model", "m", "--data-parallel-size", "2", "--port=9000",
            "--host", "0.0.0.0", "--router-policy", "round_robin", "-tp", "2", "--protect-metrics",
            "--api-key", "k", "--max-num-seqs", "8"]
    assert replica_arguments(argv) == ["--log-level", "INFO", "serve", "--model", "m", "-tp", "2",
                                       "--max-num-seqs", "8"]


def test_two_replicas_behind_the_router(tiny_llama):
    server = ServerProcess("--model", str(tiny_llama), "--disable-web-ui", "--num-kv-blocks", "1024",
                           "--data-parallel-size", "2", "--data-parallel-base-port", "0")
    try:
        replicas = replica_urls(server.process.pid)
        assert len(replicas) == 2
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with ThreadPoolExecutor(64) as pool:
            routed = list(pool.map(lambda p: complete(client, p), PROMPTS))
        assert all(routed)
        served = {url: successes(url) for url in replicas.values()}
        assert sum(served.values()) == 64 and all(count > 0 for count in served.values()), served

        one = openai.OpenAI(base_url=next(iter(replicas.values())) + "/v1", api_key="unused", max_retries=0)
        with ThreadPoolExecutor(64) as pool:
            alone = list(pool.map(lambda p: complete(one, p), PROMPTS))
        assert routed == alone

        # The Gateway API Inference Extension's default metric names, on each replica.
        for url in replicas.values():
            text = httpx.get(url + "/metrics").text
            for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
                assert f'{name}{{model_name="llama"}} 0.0' in text
            assert 'vllm:cache_config_info{block_size="16",num_gpu_blocks="1024"} 1.0' in text
            assert httpx.get(url + "/get_load").json() == {"load": 0, "num_running": 0, "num_waiting": 0}

        # Kill one replica while 64 longer requests are in flight, some of them on it.
        victim, victim_url = next(iter(replicas.items()))

        def attempt(index: int) -> str:
            """Even requests whole, odd ones streamed (a stream cut mid-way cannot be retried)."""
            kind = "stream" if index % 2 else "whole"
            try:
                if kind == "whole":
                    text = complete(client, PROMPTS[index], max_tokens=256)
                else:
                    text = "".join(chunk.choices[0].text for chunk in client.completions.create(
                        model="llama", prompt=PROMPTS[index], max_tokens=256, temperature=0, stream=True,
                        extra_body={"ignore_eos": True}) if chunk.choices)
                return f"{kind}: ok" if text else f"{kind}: empty"
            except openai.APIError as exc:
                return f"{kind}: {type(exc).__name__}"

        with ThreadPoolExecutor(64) as pool:
            futures = [pool.submit(attempt, i) for i in range(len(PROMPTS))]
            deadline = time.monotonic() + 60
            while httpx.get(victim_url + "/get_load").json()["num_running"] < 8:
                assert time.monotonic() < deadline, "the requests never reached the replica"
                time.sleep(0.05)
            os.kill(victim, signal.SIGKILL)
            outcomes = [f.result() for f in futures]
        failed = [o for o in outcomes if not o.endswith(": ok")]
        print(f"\nreplica killed mid-run: {len(failed)} of 64 requests in flight failed "
              f"({sum(o.startswith('whole') for o in failed)} of 32 whole, "
              f"{sum(o.startswith('stream') for o in failed)} of 32 streamed): {sorted(set(failed))}")

        # Every request sent after the failure is answered (by the surviving replica).
        with ThreadPoolExecutor(16) as pool:
            after = list(pool.map(lambda p: complete(client, p), PROMPTS[:16]))
        assert after == alone[:16]
    finally:
        assert server.stop() == 0


def test_a_keyless_launch_on_a_network_address_is_refused(tiny_llama):
    """Without a key the data-parallel shape listens on loopback only: --host 0.0.0.0 is refused by
    name before any replica starts (a key, or 127.0.0.1, is what it takes)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ROSEINFER_API_KEY"}
    result = subprocess.run(
        [sys.executable, "-m", "roseinfer.cli", "serve", "--model", str(tiny_llama), "--data-parallel-size", "2",
         "--host", "0.0.0.0", "--port", "9"], capture_output=True, text=True, timeout=120, env=env,
    )
    assert result.returncode != 0
    assert "--host 0.0.0.0 needs an API key" in result.stderr, result.stderr[-2000:]


def test_router_defaults_are_accepted_and_other_values_are_not():
    """vllm-router and sglang-router add their request types' defaults to every body they forward."""
    from pydantic import ValidationError

    from roseinfer.server.protocol import ChatCompletionRequest, CompletionRequest

    forwarded = {"prompt": "hi", "echo": False, "no_stop_trim": False, "ignore_eos": True,
                 "skip_special_tokens": True, "return_hidden_states": False}
    assert CompletionRequest.model_validate(forwarded).ignore_eos
    ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "logprobs": False, "no_stop_trim": False,
        "continue_final_message": False, "separate_reasoning": True, "stream_reasoning": True,
        "return_hidden_states": False, "include_reasoning": True,
    })
    for name, value in (("no_stop_trim", True), ("return_hidden_states", True), ("continue_final_message", True)):
        with pytest.raises(ValidationError, match=name):
            CompletionRequest.model_validate({"prompt": "hi", name: value})


def test_the_router_is_behind_the_key_and_its_admin_routes_are_unreachable(tiny_llama):
    """vllm-router authenticates none of its clients and answers /add_worker (send users' prompts
    to any URL), /remove_worker and /flush_cache on the port it serves: clients now meet roseinfer's
    gateway, which checks the key on every route and forwards only the serving routes."""
    key = "dp-secret"
    server = ServerProcess("--model", str(tiny_llama), "--disable-web-ui", "--num-kv-blocks", "256",
                           "--data-parallel-size", "2", "--data-parallel-base-port", "0", "--protect-metrics",
                           env={"ROSEINFER_API_KEY": key})
    auth = {"Authorization": f"Bearer {key}"}
    try:
        for method, path in (("POST", "/add_worker?url=http://127.0.0.1:9"), ("POST", "/remove_worker?url=x"),
                             ("POST", "/flush_cache"), ("GET", "/list_workers"), ("GET", "/health")):
            assert httpx.request(method, server.url + path).status_code == 401, path
        for method, path in (("POST", "/add_worker?url=http://127.0.0.1:9"), ("GET", "/list_workers"),
                             ("POST", "/flush_cache"), ("GET", "/workers")):
            refused = httpx.request(method, server.url + path, headers=auth)
            assert refused.status_code == 404 and "not a route" in refused.json()["error"]["message"], path
        assert httpx.get(server.url + "/health", headers=auth).status_code == 200  # --protect-metrics started
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
        assert complete(client, PROMPTS[0])
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model="llama", prompt=PROMPTS[0], max_tokens=8, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if chunk.choices)
        assert streamed == complete(client, PROMPTS[0])
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
        # a page from another origin gets no CORS grant to read anything
        preflight = httpx.options(server.url + "/v1/completions", headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in preflight.headers
        # the key is in no process's command line (every local user can read those)
        for pid in replica_urls(server.process.pid):
            assert key not in Path(f"/proc/{pid}/cmdline").read_bytes().decode()
    finally:
        assert server.stop() == 0
