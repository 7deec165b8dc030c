"""Tensor parallelism across hosts: two ranks in two network namespaces joined by a veth pair, one
"host" running the engine (node rank 0) and the other only its worker (node rank 1), meeting
through torch.distributed's TCP rendezvous. The tokens are those of one rank on one host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import tiny_hf_model

from roseinfer import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[1]
HANG_GUARD_S = 240
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 50)), [100, 3, 7], list(range(200, 223))]

HOST0 = """
import json, sys
from roseinfer import LLM, SamplingParams
model, address, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = LLM(model, num_kv_blocks=64, tensor_parallel_size=2, nnodes=2, node_rank=0,
          master_addr=address, master_port=port)
prompts = [{"prompt_token_ids": p} for p in json.loads(sys.argv[4])]
outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
print(json.dumps([o.outputs[0].token_ids for o in outputs]))
llm.llm_engine.engine_core.shutdown()
"""


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    """Two network namespaces, 10.213.<n>.1 and .2, joined by a veth pair; removed afterwards."""
    tag = os.getpid() % 100000
    hosts, links = (f"rsi{tag}h0", f"rsi{tag}h1"), (f"rsi{tag}v0", f"rsi{tag}v1")
    subnet = f"10.213.{tag % 250}"
    made = ip("netns", "add", hosts[0])
    if made.returncode:
        if "not permitted" in made.stderr or "Permission denied" in made.stderr:
            pytest.skip(f"this machine forbids network namespaces: {made.stderr.strip()}")
        raise RuntimeError(f"ip netns add failed: {made.stderr}")
    try:
        steps = [
            ("netns", "add", hosts[1]),
            ("link", "add", links[0], "type", "veth", "peer", "name", links[1]),
            ("link", "set", links[0], "netns", hosts[0]),
            ("link", "set", links[1], "netns", hosts[1]),
            ("-n", hosts[0], "addr", "add", f"{subnet}.1/24", "dev", links[0]),
            ("-n", hosts[1], "addr", "add", f"{subnet}.2/24", "dev", links[1]),
        ]
        for index in range(2):
            steps += [("-n", hosts[index], "link", "set", links[index], "up"), ("-n", hosts[index], "link", "set", "lo", "up")]
        for step in steps:
            done = ip(*step)
            assert done.returncode == 0, f"ip {' '.join(step)}: {done.stderr}"
        yield hosts, f"{subnet}.1"
    finally:
        for host in hosts:
            ip("netns", "del", host)  # takes its end of the veth pair with it


def test_two_ranks_on_two_hosts(two_hosts, tmp_path):
    (host0, host1), address = two_hosts
    model = tmp_path / "llama"
    tiny_hf_model("llama", model)
    expected = [
        o.outputs[0].token_ids
        for o in LLM(str(model), num_kv_blocks=64).generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False,
        )
    ]
    port = "29" + str(400 + os.getpid() % 500)
    environment = os.environ | {"PYTHONPATH": str(REPO), "ROSEINFER_TP_SECRET": "a shared secret of both hosts"}
    worker_host = subprocess.Popen(
        ["ip", "netns", "exec", host1, sys.executable, "-m", "roseinfer.cli", "serve", "--tensor-parallel-size", "2",
         "--nnodes", "2", "--node-rank", "1", "--master-addr", address, "--master-port", port],
        cwd=REPO, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        engine_host = subprocess.run(
            ["ip", "netns", "exec", host0, sys.executable, "-c", HOST0, str(model), address, port, json.dumps(PROMPTS)],
            cwd=REPO, env=environment, capture_output=True, text=True, timeout=HANG_GUARD_S,
        )
        assert engine_host.returncode == 0, engine_host.stderr[-3000:]
        assert json.loads(engine_host.stdout.strip().splitlines()[-1]) == expected
        # Host 0's engine shut down: host 1's worker leaves and its command ends cleanly.
        assert worker_host.wait(HANG_GUARD_S) == 0, worker_host.stdout.read()[-3000:]
    finally:
        if worker_host.poll() is None:
            worker_host.kill()
            worker_host.wait()


def test_ranks_launched_by_torchrun(tmp_path):
    """`torchrun --nproc-per-node 2 -m roseinfer.cli generate --tensor-parallel-size 2`: the
    process of rank 0 runs the engine, the other only its worker; same text as one rank."""
    model = tmp_path / "llama"
    tiny_hf_model("llama", model)
    command = ["-m", "roseinfer.cli", "generate", "--model", str(model), "--max-new-tokens", "12",
               "--num-kv-blocks", "64", "The quick brown fox", "def add(a, b):"]
    environment = os.environ | {"PYTHONPATH": str(REPO), "ROSEINFER_TP_SECRET": "a shared secret of both hosts"}
    one = subprocess.run([sys.executable, *command], cwd=REPO, env=environment, capture_output=True, text=True,
                         timeout=HANG_GUARD_S)
    assert one.returncode == 0, one.stderr[-3000:]
    port = str(29000 + os.getpid() % 900)
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port,
         *command, "--tensor-parallel-size", "2"],
        cwd=REPO, env=environment, capture_output=True, text=True, timeout=HANG_GUARD_S,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert "### request 1" in one.stdout
    assert two.stdout == one.stdout
