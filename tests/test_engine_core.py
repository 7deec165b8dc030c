"""The engine core driven step by step on a tiny random Llama: what each `SchedulerOutput` tells the
model runner and what each `EngineCoreOutputs` tells the front end, through chunked prefill,
preemption, every stop the core decides, and aborts. And the messages survive msgpack."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_core_support import greedy_reference, make_core, request
from support import tiny_hf_model

from roseinfer.common import serial
from roseinfer.common.messages import EngineCoreRequest, ModelRunnerOutput
from roseinfer.core.engine_core import EngineCore
from roseinfer.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("tiny") / "llama"
    return path, tiny_hf_model("llama", path)


def run_to_end(core: EngineCore) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return tokens


def test_chunked_prefill_messages_and_outputs(tiny_llama):
    path, model = tiny_llama
    core = make_core(path, max_num_batched_tokens=16)
    prompt = list(range(5, 45))  # 40 tokens: chunks of 16, 16, 8
    core.add_request(request("a", prompt, max_tokens=3))

    first = core.scheduler.schedule()
    (new,) = first.scheduled_new_reqs
    assert (new.req_id, new.prompt_token_ids, new.num_computed_tokens) == ("a", prompt, 0)
    assert len(new.block_ids[0]) == 4 and first.num_scheduled_tokens == {"a": 16}
    outputs = core.scheduler.update_from_output(first, core.executor.execute_model(first))
    assert outputs.outputs == []  # a prompt chunk that does not reach the end samples nothing
    assert outputs.scheduler_stats.num_running == 1

    second = core.scheduler.schedule()
    (cached,) = second.scheduled_cached_reqs
    assert (cached.num_computed_tokens, cached.new_token_ids) == (16, [])
    assert len(cached.block_ids[0]) == 8  # the table grew: the runner gets it whole
    core.scheduler.update_from_output(second, core.executor.execute_model(second))

    third = core.scheduler.schedule()
    assert third.num_scheduled_tokens == {"a": 8} and len(third.scheduled_cached_reqs[0].block_ids[0]) == 10
    (output,) = core.scheduler.update_from_output(third, core.executor.execute_model(third)).outputs
    expected = greedy_reference(model, prompt, 3)
    assert output.new_token_ids == expected[:1] and not output.finished

    decode = core.scheduler.schedule()
    assert decode.num_scheduled_tokens == {"a": 1}
    assert decode.scheduled_cached_reqs[0].new_token_ids == expected[:1]  # what the runner learns
    assert len(decode.scheduled_cached_reqs[0].block_ids[0]) == 11  # position 40 starts a block
    core.scheduler.update_from_output(decode, core.executor.execute_model(decode))
    decode = core.scheduler.schedule()
    assert decode.scheduled_cached_reqs[0].block_ids is None  # position 41: the same block, nothing new
    rest = run_to_end_from(core, decode)
    assert rest == expected[2:]
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks


def run_to_end_from(core: EngineCore, step) -> list[int]:
    tokens = []
    outputs = core.scheduler.update_from_output(step, core.executor.execute_model(step))
    while True:
        for output in outputs.outputs:
            tokens.extend(output.new_token_ids)
            if output.finished:
                assert output.finish_reason == "length"
                return tokens
        outputs = core.step()


def test_stops_decided_by_the_core(tiny_llama):
    path, model = tiny_llama
    core = make_core(path)
    prompt = [10, 20, 30, 40, 50]
    expected = greedy_reference(model, prompt, 6)
    core.add_request(request("length", prompt, max_tokens=4))
    core.add_request(request("stop-id", prompt, stop_token_ids=[expected[2]]))
    core.add_request(request("eos", prompt, ignore_eos=False))
    core.add_request(EngineCoreRequest("eos2", prompt, SamplingParams(temperature=0.0, max_tokens=8),
                                       [expected[1]], 0.0))
    finals = {}
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            if output.finished:
                finals[output.request_id] = (output.finish_reason, output.stop_reason)
    assert finals["length"] == ("length", None)
    assert finals["stop-id"] == ("stop", expected[2])
    assert finals["eos2"] == ("stop", None)  # its EOS id was the second token
    assert finals["eos"][0] in ("stop", "length")
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks


def test_abort_frees_blocks_and_tells_the_runner(tiny_llama):
    path, _ = tiny_llama
    core = make_core(path)
    core.add_request(request("a", list(range(1, 12)), max_tokens=50))
    core.add_request(request("b", list(range(1, 9)), max_tokens=50))
    core.step()
    assert core.kv_cache.usage > 0
    assert core.abort_requests(["a", "missing"]) == ["a"]
    step = core.scheduler.schedule()
    assert step.finished_req_ids == ["a"] and list(step.num_scheduled_tokens) == ["b"]
    core.scheduler.update_from_output(step, core.executor.execute_model(step))
    assert "a" not in core.executor.model_runner.requests
    core.abort_requests(["b"])
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
    assert not core.has_unfinished_requests()


def test_preempted_requests_resume_with_new_blocks_and_the_same_tokens(tiny_llama):
    path, model = tiny_llama
    prompts = [list(range(3, 3 + n)) for n in (9, 10, 11, 12)]
    roomy = make_core(path)
    for i, prompt in enumerate(prompts):
        roomy.add_request(request(str(i), prompt, max_tokens=12))
    expected = run_to_end(roomy)

    # 4 tokens a block: too few for all four at once; no prefix cache, so a resumed request
    # recomputes from its first token.
    tight = make_core(path, num_kv_blocks=14, enable_prefix_caching=False)
    for i, prompt in enumerate(prompts):
        tight.add_request(request(str(i), prompt, max_tokens=12))
    tokens: dict[str, list[int]] = {}
    resumed = 0
    while tight.has_unfinished_requests():
        step = tight.scheduler.schedule()
        # A request the runner knows that comes back after preemption starts over (no prefix
        # caching of its blocks survives here) with a whole new block table.
        resumed += sum(1 for c in step.scheduled_cached_reqs if c.block_ids is not None and c.num_computed_tokens == 0)
        runner_output = tight.executor.execute_model(step) if not step.empty else ModelRunnerOutput()
        for output in tight.scheduler.update_from_output(step, runner_output).outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert tight.scheduler.stats.num_preemptions > 0 and resumed > 0
    assert tokens == expected
    assert tight.kv_cache.num_free_blocks == tight.kv_cache.num_blocks
    assert greedy_reference(model, prompts[0], 12) == expected["0"]


def test_messages_survive_msgpack(tiny_llama):
    path, _ = tiny_llama
    core = make_core(path)
    core_request = request("a", [1, 2, 3], stop=["x"], seed=2**64 - 1, logprobs=2, temperature=0.5)
    assert serial.decode(serial.encode(core_request)) == core_request
    core.add_request(core_request)
    step = core.scheduler.schedule()
    assert serial.decode(serial.encode(step)) == step
    runner_output = core.executor.execute_model(step)
    outputs = core.scheduler.update_from_output(step, runner_output)
    again = serial.decode(serial.encode(outputs))
    assert again.scheduler_stats == outputs.scheduler_stats
    assert again.outputs[0].new_token_ids == outputs.outputs[0].new_token_ids
    assert again.outputs[0].new_logprobs[0].logprob == outputs.outputs[0].new_logprobs[0].logprob
    with pytest.raises(TypeError, match="cannot send"):
        serial.encode(object())
    core.abort_requests(["a"])
