"""vLLM's offline entry point: `LLM(model=None, **engine_args).generate(prompts, params)`,
`.chat(conversations, params)` and `.embed(prompts, pooling_params)`, over the synchronous `LLMEngine`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, TypeVar

from tqdm.auto import tqdm

from roseinfer.engine.input_processor import ChatPrompt
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.errors import InvalidRequestError
from roseinfer.outputs import PoolingRequestOutput, RequestOutput
from roseinfer.pooling_params import PoolingParams
from roseinfer.sampling_params import RequestOutputKind, SamplingParams

PromptInput = str | Sequence[int] | dict[str, Any]
Conversation = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        # The engine under every call; its parts (scheduler, KV cache, model runner) are its views.
        # (The seed's `LLM.engine` is attached from above, by roseinfer/seed_api.py.)
        self.llm_engine = LLMEngine.from_engine_args(model, **engine_args)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> None:
        self.llm_engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order."""
        prompts_list = _normalize_prompts(prompts, prompt_token_ids)
        return self._run(prompts_list, _per_prompt_params(sampling_params, len(prompts_list)), use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        parse_special_tokens_in_messages: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them (with `tools`,
        OpenAI-style function definitions, for templates that offer them), then generate.
        Special-token strings in the messages are text unless `parse_special_tokens_in_messages`
        (see ChatPrompt)."""
        if not messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [ChatPrompt(list(c), add_generation_prompt, chat_template_kwargs, tools,
                              parse_special_tokens_in_messages) for c in conversations]
        return self._run(prompts, _per_prompt_params(sampling_params, len(prompts)), use_tqdm)

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput] | None = None,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """One vector per prompt (`output.outputs.embedding`), in input order: the prompts run
        through the same scheduler as generation, prefill only. Pooling type and normalization
        not set in `pooling_params` are the engine's (`pooling`, `pooling_normalize`). A prompt
        whose step failed has `outputs` None and its `error` (as generate's finish_reason "error")."""
        prompts_list = _normalize_prompts(prompts, prompt_token_ids)
        params_list = _per_prompt(pooling_params, len(prompts_list), PoolingParams, "pooling_params")
        return self._run(prompts_list, params_list, use_tqdm, desc="Embedding")

    def _run(
        self,
        prompts: list[str | list[int] | ChatPrompt],
        params_list: list[SamplingParams] | list[PoolingParams],
        use_tqdm: bool,
        desc: str = "Generating",
    ) -> list[RequestOutput] | list[PoolingRequestOutput]:
        """Queue every prompt with its params (all or none), step until all have finished."""
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list, strict=True):
                request_id = engine.new_request_id()
                engine.add_request(request_id, prompt, params)
                ids.append(request_id)
        except Exception:
            engine.abort_request(ids)  # leave the engine as it was
            raise

        results: dict[str, RequestOutput | PoolingRequestOutput] = {}
        progress = tqdm(total=len(ids), desc=desc, unit="req", disable=not use_tqdm, dynamic_ncols=True)
        started, generated = time.perf_counter(), 0
        try:
            while len(results) < len(ids):
                for output in engine.step():
                    if output.finished and output.request_id not in results:
                        results[output.request_id] = output
                        progress.update(1)
                        if isinstance(output, RequestOutput):
                            generated += sum(len(c.token_ids) for c in output.outputs)
                            elapsed = time.perf_counter() - started
                            progress.set_postfix_str(f"output {generated / max(elapsed, 1e-9):.1f} tok/s")
        finally:
            progress.close()
            engine.abort_request([i for i in ids if i not in results])
        return [results[request_id] for request_id in ids]


def _normalize_prompts(
    prompts: PromptInput | Sequence[PromptInput] | None,
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


P = TypeVar("P", SamplingParams, PoolingParams)


def _per_prompt(params: P | Sequence[P] | None, count: int, kind: type[P], name: str) -> list[P]:
    """One params object per prompt: the one given (or the default) for all, or a list of exactly
    one each; `name` is the argument's, for the error."""
    if params is None or isinstance(params, kind):
        return [params or kind()] * count
    items = list(params)
    if len(items) != count:
        raise InvalidRequestError(f"got {len(items)} {name} for {count} prompts", name)
    return items


def _per_prompt_params(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    """One SamplingParams per prompt, each asking for its final output only."""
    params = _per_prompt(sampling_params, count, SamplingParams, "sampling_params")
    finals = {id(p): _final_only(p) for p in params}  # a params object shared by all is copied once
    return [finals[id(p)] for p in params]


def _final_only(params: SamplingParams) -> SamplingParams:
    if params.output_kind == RequestOutputKind.FINAL_ONLY:
        return params
    return replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
