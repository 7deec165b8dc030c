"""Per-request sampling and stopping parameters, validated up front with errors that name the field."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from roseinfer.errors import InvalidRequestError
from roseinfer.structured_output_params import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_N = 16
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


class RequestOutputKind(enum.IntEnum):
    """What each `RequestOutput` of a request holds (vLLM's names)."""

    CUMULATIVE = 0  # every output so far, each step
    DELTA = 1  # only what is new since the last output (streaming)
    FINAL_ONLY = 2  # one output, when the request has finished


@dataclass
class SamplingParams:
    """What to sample and when to stop, as vLLM spells it.

    temperature 0 means greedy. top_k 0 or -1 disables top-k; top_p 1 disables nucleus sampling;
    min_p 0 disables min-p. `seed` makes a request reproducible whatever else is in the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # The output must match this grammar (JSON schema, regex, choice, Lark/GBNF); a dict is read
    # as vLLM's `structured_outputs` request field.
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, -100..100
    # vLLM's: with a reasoning parser, the most tokens the thinking may take; then the end of
    # thinking is forced (None: no limit; 0: the thinking is closed at once).
    thinking_token_budget: int | None = None
    # Derived in __post_init__: the stop strings as a list.
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.output_kind = RequestOutputKind(self.output_kind)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {message}", param=param)

        for name in _FLOAT_FIELDS:  # NaN slips through every range check; infinities break sampling
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise bad(name, f"must be a finite number, got {value!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be at least 1, got {self.n!r}")
        if self.n > MAX_N:
            raise bad("n", f"must be at most {MAX_N}, got {self.n}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be -1 (disabled), 0 (disabled) or positive, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {value!r}")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens",
                f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be between 0 and {MAX_LOGPROBS}, got {self.logprobs!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64
        ):
            raise bad("seed", f"must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams or a dict")
        if self.logit_bias is not None:
            self.logit_bias = _checked_logit_bias(self.logit_bias)
        budget = self.thinking_token_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise bad("thinking_token_budget", f"must be a whole number >= 0, got {budget!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @classmethod
    def from_seed_args(
        cls,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop_on_eos: bool = True,
        do_sample: bool = False,
        seed: int | None = None,
    ) -> SamplingParams:
        """The seed's spelling: greedy unless do_sample, stop_on_eos instead of ignore_eos.

        Every value is validated even when do_sample is off, so a bad top_p is never silently ignored.
        """
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidRequestError(
                f"max_new_tokens must be at least 1, got {max_new_tokens!r}", param="max_new_tokens"
            )
        params = cls(
            max_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            ignore_eos=not stop_on_eos,
            seed=seed,
        )
        if not do_sample:
            params.temperature = 0.0
        return params


MAX_LOGIT_BIAS_ENTRIES = 1024  # and the vocabulary's size, which the input processor checks the ids against


def _checked_logit_bias(bias: Any) -> dict[int, float]:
    """OpenAI's rule: token ids (ints, or their decimal strings in JSON) to biases in [-100, 100];
    at most MAX_LOGIT_BIAS_ENTRIES of them."""
    if not isinstance(bias, dict):
        raise InvalidRequestError("logit_bias must be an object of token id -> bias", param="logit_bias")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(
            f"logit_bias has {len(bias)} entries, more than the limit of {MAX_LOGIT_BIAS_ENTRIES}", param="logit_bias"
        )
    checked: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            token_id = -1
        if isinstance(key, bool) or token_id < 0 or (isinstance(key, str) and not key.strip().isdigit()):
            raise InvalidRequestError(f"logit_bias key {key!r} is not a token id", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                or not -100 <= value <= 100:
            raise InvalidRequestError(
                f"logit_bias[{key}] must be a number in [-100, 100], got {value!r}", param="logit_bias"
            )
        checked[token_id] = float(value)
    return checked
