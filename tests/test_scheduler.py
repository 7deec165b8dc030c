"""The scheduler on its own: token budget, chunked prefill, seats, preemption of the newest.

No model runs here: after each step the test hands the scheduler a token for every caught-up
request, as the model runner would with a sampled token.
"""

import pytest

from roseinfer.common.messages import ModelRunnerOutput
from roseinfer.core.kv_cache import KVCacheCoordinator, KVCacheManager
from roseinfer.core.request import Request, RequestStatus
from roseinfer.core.scheduler import Scheduler
from roseinfer.sampling_params import SamplingParams


def coordinator(num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> KVCacheCoordinator:
    """One full-attention group, as a Llama-like model has."""
    return KVCacheCoordinator([KVCacheManager(num_blocks, block_size, enable_prefix_caching)])


def make_request(request_id: int, prompt_len: int, max_tokens: int = 100) -> Request:
    return Request(request_id, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), max_tokens)


def run_step(scheduler: Scheduler) -> dict[int, int]:
    """One step with a stand-in runner: every request its step catches up samples token 7."""
    out = scheduler.schedule()
    requests = [scheduler.requests[req_id] for req_id in out.num_scheduled_tokens]
    sampled = [r.request_id for r in requests if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens]
    scheduler.update_from_output(out, ModelRunnerOutput(sampled, [[7]] * len(sampled)))
    return dict(out.num_scheduled_tokens)


def test_long_prompt_is_prefilled_in_chunks_that_share_steps_with_decodes():
    scheduler = Scheduler(coordinator(64, 16), max_num_seqs=8, max_num_batched_tokens=32)
    short, long = make_request(0, 5), make_request(1, 100)
    scheduler.add_request(short)
    scheduler.add_request(long)
    assert run_step(scheduler) == {0: 5, 1: 27}  # the prompt and the first chunk share the budget
    assert run_step(scheduler) == {0: 1, 1: 31}  # a decode and a chunk in one step
    assert run_step(scheduler) == {0: 1, 1: 31}
    assert run_step(scheduler) == {0: 1, 1: 11}  # the last chunk; its last token gets a sample
    assert long.num_output_tokens == 1 and long.num_computed_tokens == 100
    assert run_step(scheduler) == {0: 1, 1: 1}


def test_max_num_seqs_limits_the_running_batch():
    scheduler = Scheduler(coordinator(64, 16), max_num_seqs=2, max_num_batched_tokens=512)
    for i in range(3):
        scheduler.add_request(make_request(i, 4))
    assert set(run_step(scheduler)) == {0, 1}
    assert scheduler.num_waiting == 1
    scheduler.finish_requests([scheduler.running[0].request_id], RequestStatus.FINISHED_STOPPED)
    assert set(run_step(scheduler)) == {1, 2}


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_newest_request_is_preempted_and_recomputed(prefix_caching):
    kv = coordinator(num_blocks=3, block_size=4, enable_prefix_caching=prefix_caching)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    old, new = make_request(0, 4), make_request(1, 4)
    scheduler.add_request(old)
    scheduler.add_request(new)
    run_step(scheduler)  # each holds one full block; one block is left
    run_step(scheduler)  # both cross into a second block: the newest cannot get one
    assert new.status == RequestStatus.WAITING and new.num_preemptions == 1
    assert new.num_computed_tokens == 0 and new.num_output_tokens == 1  # its sample is kept
    assert scheduler.stats.num_preemptions == 1
    assert kv.block_table(1) == [[]]
    scheduler.finish_requests([old.request_id], RequestStatus.FINISHED_STOPPED)
    if prefix_caching:  # its first block is still cached: only the token after it is computed
        assert run_step(scheduler) == {1: 1}
    else:  # prompt + the token it had: recomputed in one go
        assert run_step(scheduler) == {1: 5}
    kv.check_invariants()


def test_a_request_that_cannot_ever_fit_is_reported_stuck():
    scheduler = Scheduler(coordinator(num_blocks=1, block_size=4), max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request(0, 9))
    assert scheduler.schedule().empty
    assert scheduler.stuck_request().request_id == 0
