"""From engine-core outputs (token ids) to what callers get: `RequestOutput`s with text.

Per sequence: incremental detokenizing, stop strings (a stop string ends the sequence here, and the
engine core is told to abort it), held-back text, logprobs. Per request: its n sequences gathered
into one `RequestOutput`, whole or as deltas (`RequestOutputKind`), and the timing figures the
metrics need.

While a sequence runs, the last `len(longest stop string) - 1` characters are held back, so a stop
string that is still being completed never reaches the client; the text before a stop string is
all that is ever sent (unless include_stop_str_in_output).

A pooling request (an embedding) has no text: its one engine-core output carries the pooled
hidden state, which becomes a `PoolingRequestOutput` (truncated and normalized by its
`PoolingParams`) through the same `process_outputs`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from roseinfer.common.messages import EngineCoreOutput, EngineCoreOutputs
from roseinfer.detokenizer import IncrementalDetokenizer
from roseinfer.engine.stats import FinishedRequestStats, IterationStats
from roseinfer.outputs import (
    CompletionOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from roseinfer.pooling_params import PoolingParams, finish_embedding
from roseinfer.sampling_params import RequestOutputKind, SamplingParams
from roseinfer.tokenizer import Tokenizer


class SequenceText:
    """One sequence's text as it is generated: detokenized, checked for stop strings."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self._stops = params.stop_strings
        self._include_stop = params.include_stop_str_in_output
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        self.text = ""
        self._sent = 0  # characters of `text` already handed out

    def add_token(self, token_id: int) -> str | None:
        """Append one token; returns the stop string it completed, if any."""
        new_text = self._detokenizer.add_tokens([token_id])
        if not new_text:
            return None
        self.text += new_text
        return self._check_stop(len(new_text))

    def _check_stop(self, num_new_chars: int) -> str | None:
        if not self._stops:
            return None
        # A stop string ending in the new text starts at most longest-1 characters before it.
        search_from = max(0, len(self.text) - num_new_chars - self._longest_stop + 1)
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = self.text.find(stop, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop)] if self._include_stop else self.text[:at]
        return stop

    def take_delta(self, finished: bool, stopped_by_string: bool = False) -> str:
        """Text not handed out yet; while running, minus what could still become a stop string."""
        if finished:
            if not stopped_by_string:
                self.text += self._detokenizer.flush()
            end = len(self.text)
        else:
            end = max(self._sent, len(self.text) - max(self._longest_stop - 1, 0))
        delta = self.text[self._sent : end]
        self._sent = end
        return delta


class SequenceState:
    """One generated sequence of a request (the engine core's request `request_id`)."""

    def __init__(self, request_id: str, index: int, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.request_id = request_id
        self.index = index
        self.text = SequenceText(tokenizer, params)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.error_param: str | None = None
        self.last_token_time: float | None = None
        # Handed out so far, for DELTA outputs.
        self._sent_tokens = 0
        self._sent_logprobs = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def completion(self, kind: RequestOutputKind, text_delta: str) -> CompletionOutput:
        token_ids, logprobs = self.token_ids, self.logprobs
        text = self.text.text
        if kind == RequestOutputKind.DELTA:
            token_ids, text = token_ids[self._sent_tokens :], text_delta
            if logprobs is not None:
                logprobs = logprobs[self._sent_logprobs :]
                self._sent_logprobs += len(logprobs)
            self._sent_tokens += len(token_ids)
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=list(token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=list(logprobs) if logprobs is not None else None,
            error=self.error,
            error_param=self.error_param,
        )


@dataclass
class ParentRequest:
    """A caller's request: its prompt and its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    sequences: list[SequenceState]
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_cached_tokens: int = 0
    grammar_compile_time: float | None = None
    structured_output_kind: str | None = None  # "json", "regex", ... for the metrics

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.sequences)

    def metrics(self) -> RequestMetrics:
        finished = [seq.last_token_time for seq in self.sequences if seq.finished and seq.last_token_time]
        return RequestMetrics(
            arrival_time=self.arrival_time,
            first_scheduled_time=self.first_scheduled_time,
            first_token_time=self.first_token_time,
            finished_time=max(finished, default=None) if self.finished else None,
            num_cached_tokens=self.num_cached_tokens,
            grammar_compile_time=self.grammar_compile_time,
        )


@dataclass
class PoolingRequest:
    """A caller's pooling request (one engine-core request of the same id)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: PoolingParams
    arrival_time: float

    def output(self, core: EngineCoreOutput | None, now: float) -> PoolingRequestOutput:
        """Its one output: the vector, or (core None: aborted here) why there is none."""
        metrics = RequestMetrics(self.arrival_time, finished_time=now)
        if core is None:
            return PoolingRequestOutput(self.request_id, self.prompt, self.prompt_token_ids, None,
                                        finish_reason="abort", metrics=metrics)
        metrics.first_scheduled_time, metrics.num_cached_tokens = core.first_scheduled_time, core.num_cached_tokens
        if core.finish_reason == "stop" and core.pooled is not None:
            pooled = PoolingOutput(finish_embedding(core.pooled, self.params))
            return PoolingRequestOutput(self.request_id, self.prompt, self.prompt_token_ids, pooled, metrics=metrics)
        return PoolingRequestOutput(self.request_id, self.prompt, self.prompt_token_ids, None,
                                    finish_reason=core.finish_reason, error=core.error, metrics=metrics)


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput | PoolingRequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)  # ended by a stop string here
    iteration_stats: IterationStats = field(default_factory=IterationStats)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentRequest] = {}
        self.sequences: dict[str, tuple[ParentRequest, SequenceState]] = {}  # engine-core ids
        self.pooling: dict[str, PoolingRequest] = {}  # pooling requests (caller's id = engine-core id)

    # -- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        sequence_ids: list[str],
        arrival_time: float,
    ) -> None:
        if request_id in self.parents or request_id in self.pooling:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(params, PoolingParams):
            if sequence_ids != [request_id]:
                raise ValueError(f"a pooling request is one engine-core request of its own id, got {sequence_ids}")
            self.pooling[request_id] = PoolingRequest(request_id, prompt, prompt_token_ids, params, arrival_time)
            return
        sequences = [SequenceState(seq_id, index, self.tokenizer, params) for index, seq_id in enumerate(sequence_ids)]
        parent = ParentRequest(request_id, prompt, prompt_token_ids, params.output_kind, sequences, arrival_time)
        if params.structured_outputs is not None:
            parent.structured_output_kind = params.structured_outputs.kind
        self.parents[request_id] = parent
        for seq in sequences:
            self.sequences[seq.request_id] = (parent, seq)

    def abort_request(self, request_id: str) -> tuple[list[str], RequestOutput | PoolingRequestOutput | None]:
        """Forget a caller's request; returns the engine-core ids of its unfinished sequences and
        its last output, those sequences ended with finish_reason "abort"."""
        pooling = self.pooling.pop(request_id, None)
        if pooling is not None:
            return [request_id], pooling.output(None, time.monotonic())
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return [], None
        unfinished = []
        for seq in parent.sequences:
            self.sequences.pop(seq.request_id, None)
            if not seq.finished:
                unfinished.append(seq.request_id)
                seq.finish_reason = "abort"
        deltas = {seq.index: seq.text.take_delta(True) for seq in parent.sequences if seq.request_id in unfinished}
        return unfinished, self._request_output(parent, deltas)

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents) or bool(self.pooling)

    @property
    def num_unfinished_sequences(self) -> int:
        return len(self.sequences) + len(self.pooling)

    # -- one batch of engine-core outputs ---------------------------------------------------
    def process_outputs(self, core_outputs: EngineCoreOutputs, now: float | None = None) -> ProcessedOutputs:
        now = time.monotonic() if now is None else now
        processed = ProcessedOutputs()
        touched: dict[str, tuple[ParentRequest, dict[int, str]]] = {}
        for output in core_outputs.outputs:
            if output.request_id in self.pooling:
                if output.finished:
                    self._finish_pooling(self.pooling.pop(output.request_id), output, now, processed)
                continue
            entry = self.sequences.get(output.request_id)
            if entry is None:  # aborted by the caller meanwhile
                continue
            parent, seq = entry
            text_delta = self._apply(parent, seq, output, now, processed)
            touched.setdefault(parent.request_id, (parent, {}))[1][seq.index] = text_delta
        for parent, deltas in touched.values():
            request_output = self._request_output(parent, deltas)
            if request_output is not None:
                processed.request_outputs.append(request_output)
            if parent.finished:
                self._finish(parent, now, processed.iteration_stats)
        return processed

    @staticmethod
    def _finish_pooling(
        request: PoolingRequest, output: EngineCoreOutput, now: float, processed: ProcessedOutputs
    ) -> None:
        processed.request_outputs.append(request.output(output, now))
        stats = processed.iteration_stats
        stats.num_prompt_tokens += len(request.prompt_token_ids)
        queue_time = None
        if output.first_scheduled_time is not None:
            queue_time = max(output.first_scheduled_time - request.arrival_time, 0.0)
        stats.finished_requests.append(FinishedRequestStats(
            finish_reasons=[output.finish_reason or "abort"], e2e_latency=now - request.arrival_time,
            queue_time=queue_time, num_prompt_tokens=len(request.prompt_token_ids), num_generation_tokens=0,
        ))

    def _apply(
        self, parent: ParentRequest, seq: SequenceState, output: EngineCoreOutput, now: float,
        processed: ProcessedOutputs,
    ) -> str:
        stats = processed.iteration_stats
        if parent.first_scheduled_time is None:
            parent.first_scheduled_time = output.first_scheduled_time
        parent.num_cached_tokens = max(parent.num_cached_tokens, output.num_cached_tokens)
        if output.grammar_compile_time is not None:
            parent.grammar_compile_time = output.grammar_compile_time
        stop_string = None
        for position, token_id in enumerate(output.new_token_ids):
            seq.token_ids.append(token_id)
            if seq.logprobs is not None and output.new_logprobs is not None:
                entry = output.new_logprobs[position]
                seq.logprobs.append(entry)
                seq.cumulative_logprob += entry.logprob
            stop_string = seq.text.add_token(token_id)
            if stop_string is not None:
                break
        if output.new_token_ids:
            stats.num_generation_tokens += len(output.new_token_ids)
            if parent.first_token_time is None:
                parent.first_token_time = now
                stats.time_to_first_tokens.append(now - parent.arrival_time)
                stats.num_prompt_tokens += len(parent.prompt_token_ids)
            elif seq.last_token_time is not None:
                stats.inter_token_latencies.append(now - seq.last_token_time)
            seq.last_token_time = now
        if stop_string is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_string
            if not output.finished:
                processed.reqs_to_abort.append(seq.request_id)
        elif output.finished:
            seq.finish_reason, seq.stop_reason, seq.error = output.finish_reason, output.stop_reason, output.error
            seq.error_param = output.error_param
        if seq.finished:
            seq.last_token_time = seq.last_token_time or now
        return seq.text.take_delta(seq.finished, stopped_by_string=stop_string is not None)

    def _request_output(self, parent: ParentRequest, deltas: dict[int, str]) -> RequestOutput | None:
        kind = parent.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not parent.finished:
            return None
        if kind == RequestOutputKind.DELTA:
            completions = [parent.sequences[i].completion(kind, deltas[i]) for i in sorted(deltas)]
        else:
            completions = [seq.completion(kind, "") for seq in parent.sequences]
        return RequestOutput(
            parent.request_id, parent.prompt, parent.prompt_token_ids, completions, parent.finished,
            parent.metrics(),
        )

    def _finish(self, parent: ParentRequest, now: float, stats: IterationStats) -> None:
        self.parents.pop(parent.request_id, None)
        for seq in parent.sequences:
            self.sequences.pop(seq.request_id, None)
        queue_time = None
        if parent.first_scheduled_time is not None:
            queue_time = max(parent.first_scheduled_time - parent.arrival_time, 0.0)
        stats.finished_requests.append(FinishedRequestStats(
            finish_reasons=[seq.finish_reason or "abort" for seq in parent.sequences],
            e2e_latency=now - parent.arrival_time,
            queue_time=queue_time,
            num_prompt_tokens=len(parent.prompt_token_ids),
            num_generation_tokens=sum(len(seq.token_ids) for seq in parent.sequences),
            structured_output_kind=parent.structured_output_kind,
        ))
