"""Offline batch APIs over the engine: vLLM's `LLM` and the seed's `OfflineScheduler`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from roseinfer.engine import InferenceEngine
from roseinfer.errors import InvalidRequestError
from roseinfer.outputs import RequestOutput
from roseinfer.sampling_params import SamplingParams

PromptType = str | Sequence[int] | dict[str, Any]
Conversation = list[dict[str, Any]]


class OfflineScheduler:
    """The seed's batch API: add requests (also between steps), step, run to completion."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self._texts: dict[int, list[str]] = {}
        self._tokens: dict[int, list[int]] = {}
        self._finished: set[int] = set()

    def add_request(
        self,
        prompt: str,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop_on_eos: bool = True,
        do_sample: bool = False,
        seed: int | None = None,
        add_special_tokens: bool = True,
    ) -> int:
        params = SamplingParams.from_seed_args(
            max_new_tokens, temperature, top_k, top_p, stop_on_eos, do_sample, seed
        )
        request_id = self.engine.add_request(prompt, params, add_special_tokens=add_special_tokens)
        self._texts[request_id] = []
        self._tokens[request_id] = []
        return request_id

    def step(self) -> dict[int, int]:
        """One engine step; returns {request id: token generated this step} for this scheduler's requests."""
        produced: dict[int, int] = {}
        for delta in self.engine.step():
            if delta.request_id not in self._texts:
                continue
            self._texts[delta.request_id].append(delta.text)
            self._tokens[delta.request_id].extend(delta.token_ids)
            if delta.token_ids:
                produced[delta.request_id] = delta.token_ids[-1]
            if delta.finished:
                self._finished.add(delta.request_id)
        return produced

    def has_unfinished(self) -> bool:
        return len(self._finished) < len(self._texts)

    def is_finished(self, request_id: int) -> bool:
        return request_id in self._finished

    def text(self, request_id: int) -> str:
        return "".join(self._texts[request_id])

    def token_ids(self, request_id: int) -> list[int]:
        return list(self._tokens[request_id])

    def run(self) -> dict[int, str]:
        """Step until every request added here is done; returns {request id: generated text}."""
        while self.has_unfinished():
            self.step()
        return {request_id: self.text(request_id) for request_id in self._texts}


class LLM:
    """vLLM's offline entry point: `LLM(model=None, **engine_args).generate(prompts, params)`."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = InferenceEngine(model, **engine_args)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order."""
        items = _normalize_prompts(prompts, prompt_token_ids)
        return self._run(items, sampling_params, use_tqdm, add_special_tokens=True)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        if not messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts = [
            tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
            )
            for conversation in conversations
        ]
        # The template already wrote any BOS token it wants.
        return self._run(prompts, sampling_params, use_tqdm, add_special_tokens=False)

    def _run(
        self,
        items: list[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        add_special_tokens: bool,
    ) -> list[RequestOutput]:
        params_list = _per_prompt_params(sampling_params, len(items))
        engine = self.engine
        ids: list[int] = []
        try:
            for item, params in zip(items, params_list, strict=True):
                if isinstance(item, str):
                    ids.append(engine.add_request(item, params, add_special_tokens=add_special_tokens))
                else:
                    ids.append(engine.add_request(None, params, prompt_token_ids=item))
        except Exception:
            for request_id in ids:  # leave the engine as it was
                engine.abort_request(request_id)
            raise

        wanted = set(ids)
        results: dict[int, RequestOutput] = {}
        progress = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        started, generated = time.perf_counter(), 0
        try:
            while len(results) < len(ids):
                for delta in engine.step():
                    if delta.request_id not in wanted:
                        continue
                    generated += len(delta.token_ids)
                    if delta.output is not None:
                        results[delta.request_id] = delta.output
                        progress.update(1)
                        elapsed = time.perf_counter() - started
                        progress.set_postfix_str(f"output {generated / max(elapsed, 1e-9):.1f} tok/s")
        finally:
            progress.close()
            for request_id in wanted - results.keys():
                engine.abort_request(request_id)
        return [results[request_id] for request_id in ids]


def _normalize_prompts(
    prompts: PromptType | Sequence[PromptType] | None,
    prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None,
) -> list[str | list[int]]:
    if prompts is None and prompt_token_ids is None:
        raise InvalidRequestError("either prompts or prompt_token_ids is required", "prompts")
    if prompts is not None and prompt_token_ids is not None:
        raise InvalidRequestError("pass prompts or prompt_token_ids, not both", "prompt_token_ids")
    if prompt_token_ids is not None:
        if prompt_token_ids and isinstance(prompt_token_ids[0], int):
            return [list(prompt_token_ids)]
        return [list(ids) for ids in prompt_token_ids]
    if isinstance(prompts, str | dict):
        prompts = [prompts]
    elif prompts and isinstance(prompts[0], int):
        prompts = [prompts]
    items: list[str | list[int]] = []
    for prompt in prompts:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                items.append(list(prompt["prompt_token_ids"]))
            elif "prompt" in prompt:
                items.append(prompt["prompt"])
            else:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompts")
        elif isinstance(prompt, str):
            items.append(prompt)
        else:
            items.append(list(prompt))
    return items


def _per_prompt_params(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count:
        raise InvalidRequestError(
            f"got {len(params)} sampling_params for {count} prompts", "sampling_params"
        )
    return params
