"""A model step that fails ends only the request that fails it: the engine core on a tiny random
Llama, with the model runner's test-only fault (a prompt holding a configured token id makes the
step raise). The other requests of the step give transformers' greedy tokens, a seeded sampled
request gives the same tokens as alone, and every block is freed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_core_support import greedy_reference, make_core, request
from support import tiny_hf_model

from roseinfer.common.messages import EngineCoreOutput, EngineCoreRequest
from roseinfer.core.engine_core import EngineCore
from roseinfer.worker.fault_injection import FAULT_TOKEN_ENV

FAULT_TOKEN = 7
PROMPTS = {f"ok-{i}": list(range(20 + 9 * i, 31 + 9 * i)) for i in range(6)}  # none holds token 7
FAULTY = [40, 41, FAULT_TOKEN, 42, 43]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("tiny") / "llama"
    return path, tiny_hf_model("llama", path)


def run_to_end(core: EngineCore, add_later: list[EngineCoreRequest] = ()) -> dict[str, EngineCoreOutput]:
    """Step until done; `add_later` joins after two steps, while the others are decoding. Returns
    each request's outputs merged (its tokens, and its last output's finish and error)."""
    merged: dict[str, EngineCoreOutput] = {}
    steps = 0
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            seen = merged.setdefault(output.request_id, EngineCoreOutput(output.request_id, []))
            seen.new_token_ids += output.new_token_ids
            seen.finish_reason, seen.error = output.finish_reason, output.error
        steps += 1
        if steps == 2:
            for late in add_later:
                core.add_request(late)
    return merged


@pytest.mark.parametrize("joins", ["with the others", "while the others decode"])
def test_a_failing_request_ends_alone_and_its_neighbours_are_exact(tiny_llama, monkeypatch, joins):
    path, model = tiny_llama
    monkeypatch.setenv(FAULT_TOKEN_ENV, str(FAULT_TOKEN))
    core = make_core(path)
    for request_id, prompt in PROMPTS.items():
        core.add_request(request(request_id, prompt))
    core.add_request(request("seeded", PROMPTS["ok-0"], temperature=1.0, seed=1234))
    faulty = request("faulty", FAULTY)
    if joins == "with the others":
        core.add_request(faulty)
    outputs = run_to_end(core, add_later=[faulty] if joins != "with the others" else [])

    assert outputs["faulty"].finish_reason == "error" and outputs["faulty"].new_token_ids == []
    assert "injected fault" in outputs["faulty"].error
    for request_id, prompt in PROMPTS.items():
        assert outputs[request_id].finish_reason == "length"
        assert outputs[request_id].new_token_ids == greedy_reference(model, prompt, 8), request_id
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks

    # The seeded request drew the same random numbers as it does alone (no replay advanced them).
    core.add_request(request("seeded-alone", PROMPTS["ok-0"], temperature=1.0, seed=1234))
    alone = run_to_end(core)
    assert outputs["seeded"].new_token_ids == alone["seeded-alone"].new_token_ids
    # The engine goes on: the faulty request alone fails again, a clean one runs.
    core.add_request(request("faulty-again", FAULTY))
    core.add_request(request("after", PROMPTS["ok-1"]))
    after = run_to_end(core)
    assert after["faulty-again"].finish_reason == "error"
    assert after["after"].new_token_ids == outputs["ok-1"].new_token_ids
