"""What the engine-core tests share: a core over a tiny model, a greedy request, and transformers'
greedy tokens to compare with."""

from __future__ import annotations

from pathlib import Path

import torch

from roseinfer.common.messages import EngineCoreRequest
from roseinfer.config import EngineConfig
from roseinfer.core.engine_core import EngineCore
from roseinfer.core.kv_pool_plan import plan_engine
from roseinfer.models.loader import ModelSource
from roseinfer.sampling_params import SamplingParams


def make_core(path: Path, **overrides) -> EngineCore:
    config = EngineConfig(model=str(path), **({"num_kv_blocks": 64, "block_size": 4} | overrides))
    model_config = ModelSource.resolve(config.model).model_config()
    plan_engine(config, model_config)
    return EngineCore(config, model_config)


def request(request_id: str, prompt: list[int], **params) -> EngineCoreRequest:
    defaults = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
    return EngineCoreRequest(request_id, prompt, SamplingParams(**(defaults | params)), [0], 0.0)


def greedy_reference(model: torch.nn.Module, prompt: list[int], count: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=count, min_new_tokens=count, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()
