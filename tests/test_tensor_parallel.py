"""Tensor parallelism on the CPU: two ranks, one worker process each, against one rank.

For tiny random Llama, Qwen2 and GPT-2 models and for the default model: the logits of every
sampled row within 1e-4 of the single-rank engine's (the same schedules fed to both, through
chunked prefill), greedy outputs token for token equal with chunked prefill and preemption, each
rank's KV pool holding only its KV heads, and nothing left on any rank afterwards.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support import EXACT, tiny_hf_model

from roseinfer import LLM, SamplingParams
from roseinfer.common.messages import EngineCoreRequest, ModelRunnerOutput
from roseinfer.config import EngineConfig
from roseinfer.core.engine_core import EngineCore
from roseinfer.core.kv_pool_plan import plan_engine
from roseinfer.errors import InvalidRequestError
from roseinfer.models.loader import ModelSource

TOLERANCE = 1e-4
# Eight prompts: short ones, and ones longer than a step's token budget (chunked prefill).
PROMPTS = [list(range(3, 3 + n)) for n in (5, 40, 9, 23, 3, 31, 12, 17)]


def engine_config(path: Path | None, **overrides) -> tuple[EngineConfig, object]:
    defaults = {"num_kv_blocks": 96, "block_size": 4, "max_num_batched_tokens": 16, "enable_prefix_caching": False}
    config = EngineConfig(model=None if path is None else str(path), **(defaults | overrides))
    model_config = ModelSource.resolve(config.model).model_config()
    plan_engine(config, model_config)
    return config, model_config


def make_core(path: Path | None, **overrides) -> EngineCore:
    config, model_config = engine_config(path, **overrides)
    return EngineCore(config, model_config)


def request(request_id: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(request_id, prompt, params, [0], 0.0)


def compare_logits(reference: EngineCore, tp_executor, prompts: list[list[int]], max_tokens: int) -> float:
    """Schedule on the single-rank core; run every step on both executors; continue with the
    reference's greedy token. Returns the largest absolute logit difference."""
    for i, prompt in enumerate(prompts):
        reference.add_request(request(f"logits-{i}", prompt, max_tokens))
    worst = 0.0
    while reference.has_unfinished_requests():
        step = reference.scheduler.schedule()
        expected, ids = reference.executor.model_runner.compute_logits(step)
        got, tp_ids = tp_executor.compute_logits(step)
        assert tp_ids == ids
        if ids:
            worst = max(worst, (got - expected).abs().max().item())
        tokens = [[int(row.argmax())] for row in expected]
        reference.scheduler.update_from_output(step, ModelRunnerOutput(ids, tokens))
    flush(reference, tp_executor)
    return worst


def flush(core: EngineCore, *more_executors) -> None:
    """Tell the runners about the requests that finished in the last step (the scheduler sends
    their ids with the next step, and there is none)."""
    step = core.scheduler.schedule()
    assert step.empty
    for executor in (core.executor, *more_executors):
        executor.execute_model(step)


def generate(core: EngineCore, prompts: list[list[int]], max_tokens: int, prefix: str) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        core.add_request(request(f"{prefix}-{i}", prompt, max_tokens))
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            assert output.error is None, output.error
            tokens.setdefault(output.request_id.removeprefix(prefix), []).extend(output.new_token_ids)
    flush(core)
    return tokens


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2"])
def tiny_model(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tp") / request.param
    tiny_hf_model(request.param, path)
    return path


def test_two_ranks_match_one(tiny_model):
    reference = make_core(tiny_model)
    # The ranks sum through shared memory, except Qwen2's, which go through gloo's TCP.
    allreduce = "gloo" if tiny_model.name == "qwen2" else "shm"
    tp_core = make_core(tiny_model, tensor_parallel_size=2, cpu_allreduce=allreduce)
    try:
        executor = tp_core.executor
        heads = json.loads((tiny_model / "config.json").read_text())
        kv_heads = heads.get("num_key_value_heads") or heads.get("num_attention_heads") or heads["n_head"]
        states = executor.collective_rpc("cache_state")
        assert [s["kv_heads"] for s in states] == [kv_heads // 2] * 2  # each rank: only its heads
        assert {s["num_blocks"] for s in states} == {tp_core.kv_cache.num_blocks}

        assert compare_logits(reference, executor, PROMPTS, max_tokens=6) < TOLERANCE

        expected = generate(reference, PROMPTS, 10, "one")
        assert generate(tp_core, PROMPTS, 10, "two") == expected
        assert all(len(tokens) == 10 for tokens in expected.values())

        # Too few blocks for all eight at once: preemption, then recomputation; same tokens.
        tight_reference = EngineCore(*engine_config(tiny_model, num_kv_blocks=24), executor=reference.executor)
        tight_tp = EngineCore(*engine_config(tiny_model, num_kv_blocks=24), executor=executor)
        assert generate(tight_reference, PROMPTS, 10, "tight-one") == expected
        assert generate(tight_tp, PROMPTS, 10, "tight-two") == expected
        assert tight_tp.scheduler.stats.num_preemptions > 0

        for core in (tp_core, tight_tp):
            assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
        assert [s["requests"] for s in executor.collective_rpc("cache_state")] == [0, 0]
    finally:
        tp_core.shutdown()


def test_too_few_kv_heads_is_a_clear_error(tmp_path):
    path = tmp_path / "mqa"
    tiny_hf_model("llama", path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"num_key_value_heads": 1}))
    with pytest.raises(InvalidRequestError, match="more than the model's 1 KV head"):
        LLM(str(path), tensor_parallel_size=2)


def test_vocabulary_that_does_not_divide(tmp_path):
    """GPT-2's real vocabulary (50257) is odd: the ranks pad it to equal halves."""
    path = tmp_path / "gpt2-odd"
    tiny_hf_model("gpt2", path)
    config = json.loads((path / "config.json").read_text())
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    name = next(n for n in weights if n.endswith("wte.weight"))
    weights[name] = torch.cat([weights[name], torch.randn(1, weights[name].shape[1]) * 0.1])
    save_file(weights, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config | {"vocab_size": config["vocab_size"] + 1}))
    reference = make_core(path)
    tp_core = make_core(path, tensor_parallel_size=2)
    try:
        assert compare_logits(reference, tp_core.executor, PROMPTS[:3], max_tokens=3) < TOLERANCE
    finally:
        tp_core.shutdown()


def test_default_model(tmp_path):
    """The default model has 3 KV heads: rank 0 holds two, rank 1 one (and their query heads)."""
    from engine_fixtures import PROMPT_TEXTS

    one = LLM(kv_cache_memory=0.25, enable_prefix_caching=False, **EXACT)
    two = LLM(kv_cache_memory=0.25, enable_prefix_caching=False, tensor_parallel_size=2, **EXACT)
    try:
        executor = two.llm_engine.engine_core.executor
        assert [s["kv_heads"] for s in executor.collective_rpc("cache_state")] == [2, 1]
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        conversations = [[{"role": "user", "content": text}] for text in PROMPT_TEXTS]
        expected = [o.outputs[0].token_ids for o in one.chat(conversations, params, use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in two.chat(conversations, params, use_tqdm=False)] == expected

        tokenizer = one.get_tokenizer()
        prompts = [tokenizer.encode(text) for text in PROMPT_TEXTS[2:5]]  # 12, 20, 5 tokens: 20 is chunked
        reference = EngineCore(*engine_config(None, block_size=16, max_num_batched_tokens=24),
                               executor=one.llm_engine.engine_core.executor)
        assert compare_logits(reference, executor, prompts, max_tokens=3) < TOLERANCE
    finally:
        two.llm_engine.engine_core.shutdown()


def test_engine_arguments_are_checked():
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(InvalidRequestError, match="cannot share 3 ranks"):
        EngineConfig(tensor_parallel_size=3, nnodes=2, master_port=29500)
    with pytest.raises(InvalidRequestError, match="master_port"):
        EngineConfig(tensor_parallel_size=2, nnodes=2)
    with pytest.raises(InvalidRequestError, match="core list"):
        EngineConfig(cpu_threads_bind="0-x")
    with pytest.raises(InvalidRequestError, match="'uni' runs one rank"):
        EngineConfig(tensor_parallel_size=2, distributed_executor_backend="uni")


def test_cpu_binding_plans():
    import os

    from roseinfer.distributed.cpu_binding import plan_cpu_binding

    assert plan_cpu_binding("0-3|4,6", 2) == [[0, 1, 2, 3], [4, 6]]
    assert plan_cpu_binding("none", 2) == [None, None]
    cores = sorted(os.sched_getaffinity(0))
    auto = plan_cpu_binding("auto", 2)
    if len(cores) >= 2:  # disjoint runs covering every core
        assert sorted(auto[0] + auto[1]) == cores and not set(auto[0]) & set(auto[1])
    with pytest.raises(InvalidRequestError, match="2 core list"):
        plan_cpu_binding("0|1", 3)
