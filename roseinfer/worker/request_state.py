"""What the model runner keeps of each request between steps, learnt from the scheduler's messages."""

from __future__ import annotations

import torch

from roseinfer.common.messages import NewRequestData
from roseinfer.pooling_params import PoolingParams
from roseinfer.sampling_params import SamplingParams


class CachedRequestState:
    """What the runner keeps of a request between steps."""

    __slots__ = ("req_id", "token_ids", "num_prompt_tokens", "sampling_params", "eos_token_ids", "block_ids",
                 "num_computed_tokens", "generator", "logit_bias", "pooling_params", "pool_sum", "pool_count",
                 "pool_before_last", "images")

    def __init__(self, new: NewRequestData) -> None:
        self.req_id = new.req_id
        self.token_ids = list(new.prompt_token_ids) + list(new.output_token_ids)
        self.num_prompt_tokens = len(new.prompt_token_ids)
        self.sampling_params: SamplingParams | None = new.sampling_params
        self.pooling_params: PoolingParams | None = new.pooling_params
        # Mean pooling over a prompt run in chunks: the sum of the rows so far and how many.
        self.pool_sum: torch.Tensor | None = None
        self.pool_count = 0
        self.pool_before_last: tuple[torch.Tensor | None, int] = (None, 0)  # to run the last chunk again
        self.eos_token_ids = new.eos_token_ids
        self.block_ids = list(new.block_ids)
        self.num_computed_tokens = new.num_computed_tokens
        self.images = new.images  # a vision-language prompt's images (their placeholder runs)
        self.generator: torch.Generator | None = None  # seeded sampling, made on first use
        # (token ids, biases) on the device, built on first use: not again at every step.
        self.logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens
