"""Tensor-parallel workers that fail: a worker that raises or dies ends every request in flight
with an error and stops the engine (the server then answers 503), never a hang; SIGTERM to the
server stops every worker."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from live_server import ServerProcess
from support import tiny_hf_model

from roseinfer.common.messages import CachedRequestData, EngineCoreRequest, SchedulerOutput
from roseinfer.config import EngineConfig
from roseinfer.core.engine_core import EngineCore
from roseinfer.core.kv_pool_plan import plan_engine
from roseinfer.errors import EngineDeadError, ExecutorFailedError
from roseinfer.models.loader import ModelSource
from roseinfer.sampling_params import SamplingParams

HANG_GUARD_S = 60  # far beyond the few seconds a failure takes; only a hang reaches it


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tp-faults") / "llama"
    tiny_hf_model("llama", path)
    return path


def worker_pids(parent: int) -> list[int]:
    """The tensor-parallel worker processes started by `parent` (from /proc)."""
    children = []
    for task in Path(f"/proc/{parent}/task").iterdir():
        children += [int(pid) for pid in (task / "children").read_text().split()]
    return [pid for pid in children if b"roseinfer.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"hung: {what}"
        time.sleep(0.05)


def make_core(path: Path) -> EngineCore:
    config = EngineConfig(model=str(path), num_kv_blocks=64, block_size=4, tensor_parallel_size=2)
    model_config = ModelSource.resolve(config.model).model_config()
    plan_engine(config, model_config)
    return EngineCore(config, model_config)


def request(request_id: str) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    return EngineCoreRequest(request_id, [5, 6, 7, 8, 9], params, [0], 0.0)


def test_a_worker_that_raises_fails_the_executor(tiny_llama):
    core = make_core(tiny_llama)
    try:
        # A step about a request no rank has heard of: every rank raises in its runner.
        bogus = SchedulerOutput(scheduled_cached_reqs=[CachedRequestData("ghost", [], None, 0)],
                                num_scheduled_tokens={"ghost": 1}, total_num_scheduled_tokens=1)
        with pytest.raises(ExecutorFailedError, match=r"rank \d failed: KeyError"):
            core.executor.execute_model(bogus)
        wait_until(lambda: core.executor.workers.first_dead() is not None, "workers to exit")
        for process in core.executor.workers.processes:
            process.wait(HANG_GUARD_S)
        with pytest.raises(ExecutorFailedError):
            core.executor.execute_model(bogus)
    finally:
        core.shutdown()


def test_a_worker_that_dies_ends_the_requests_in_flight(tiny_llama):
    core = make_core(tiny_llama)
    try:
        core.add_request(request("a"))
        core.add_request(request("b"))
        assert all(o.error is None for o in core.step().outputs)
        os.kill(core.executor.workers.processes[1].pid, signal.SIGKILL)
        outputs = core.step().outputs  # the step finds rank 1 gone
        assert {o.request_id for o in outputs} == {"a", "b"}
        assert all(o.finish_reason == "error" and "rank 1 exited" in o.error for o in outputs)
        assert core.dead_reason is not None and not core.has_unfinished_requests()
        assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
        with pytest.raises(EngineDeadError):
            core.add_request(request("c"))
        assert core.executor.workers.first_dead() is not None
        core.executor.workers.processes[0].wait(HANG_GUARD_S)  # rank 0 was stopped too
    finally:
        core.shutdown()


def test_server_answers_errors_when_a_worker_is_killed(tiny_llama):
    server = ServerProcess("--model", str(tiny_llama), "--tensor-parallel-size", "2", "--disable-web-ui",
                           "--num-kv-blocks", "512")
    try:
        workers = worker_pids(server.process.pid)
        assert len(workers) == 2
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        started = threading.Barrier(5)
        results: dict[int, str] = {}

        def stream(index: int) -> None:
            chunks = 0
            try:
                for _ in client.completions.create(
                    model="llama", prompt=f"stream {index}", max_tokens=400, temperature=0, stream=True,
                    extra_body={"ignore_eos": True},
                ):
                    chunks += 1
                    if chunks == 1:
                        started.wait()
                results[index] = "finished"  # must not happen: 400 tokens take far longer
            except openai.APIError as exc:
                results[index] = f"error: {exc}"

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        started.wait(HANG_GUARD_S)  # every stream has its first tokens
        os.kill(workers[1], signal.SIGKILL)
        for thread in threads:
            thread.join(HANG_GUARD_S)
            assert not thread.is_alive(), "a stream hung after its worker died"
        assert len(results) == 4 and all("rank 1 exited" in r for r in results.values()), results

        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model="llama", prompt="after", max_tokens=4)
        assert refused.value.status_code == 503
        wait_until(lambda: not any(running(pid) for pid in workers), "rank 0 to be stopped")
    finally:
        server.stop()


def test_sigterm_stops_every_worker(tiny_llama):
    server = ServerProcess("--model", str(tiny_llama), "--tensor-parallel-size", "2", "--disable-web-ui",
                           "--num-kv-blocks", "64")
    workers = worker_pids(server.process.pid)
    assert len(workers) == 2 and all(running(pid) for pid in workers)
    assert server.stop() == 0
    wait_until(lambda: not any(running(pid) for pid in workers), "the workers to exit")
