"""The output processor on the default model's tokenizer, fed engine-core outputs by hand: stop
strings that span token boundaries, held-back text, what the engine core is told to abort, delta
and final outputs, n > 1 requests gathered into one output."""

from __future__ import annotations

import pytest

from roseinfer.common.messages import EngineCoreOutput, EngineCoreOutputs
from roseinfer.engine.output_processor import OutputProcessor
from roseinfer.sampling_params import RequestOutputKind, SamplingParams

TEXT = "The answer is forty-two, and the question is unknown."


@pytest.fixture
def processor(smollm_tokenizer) -> OutputProcessor:
    return OutputProcessor(smollm_tokenizer)


def feed(processor: OutputProcessor, request_id: str, token_ids: list[int], finish_last: str | None = None):
    """One engine-core output per token, as decode steps produce them; returns every result."""
    results = []
    for position, token_id in enumerate(token_ids):
        last = position == len(token_ids) - 1
        output = EngineCoreOutput(request_id, [token_id], finish_reason=finish_last if last else None)
        results.append(processor.process_outputs(EngineCoreOutputs([output])))
    return results


def test_a_stop_string_split_across_tokens_ends_the_sequence(processor, smollm_tokenizer):
    ids = smollm_tokenizer.encode(TEXT, add_special_tokens=False)
    stop = "forty-two"  # several tokens: "forty", "-", "two" or similar
    assert len([i for i in ids if smollm_tokenizer.decode([i]) in stop]) > 1
    params = SamplingParams(stop=[stop], output_kind=RequestOutputKind.DELTA)
    processor.add_request("r", None, [1], params, ["r"], 0.0)
    results = feed(processor, "r", ids)
    texts = [o.outputs[0].text for r in results for o in r.request_outputs]
    assert "".join(texts) == TEXT[: TEXT.index(stop)]
    assert not any("forty" in t for t in texts)  # held back until it could not be anything else
    stopped_at = next(i for i, r in enumerate(results) if r.reqs_to_abort)
    assert results[stopped_at].reqs_to_abort == ["r"]  # the engine core did not know: it is told
    final = results[stopped_at].request_outputs[0]
    assert final.finished and final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop
    assert not processor.has_unfinished_requests()
    assert all(not r.request_outputs for r in results[stopped_at + 1 :])  # later outputs are dropped


def test_include_stop_str_and_final_only(processor, smollm_tokenizer):
    ids = smollm_tokenizer.encode(TEXT, add_special_tokens=False)
    params = SamplingParams(stop=["question"], include_stop_str_in_output=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    processor.add_request("r", "prompt", [1], params, ["r"], 0.0)
    results = feed(processor, "r", ids)
    outputs = [o for r in results for o in r.request_outputs]
    assert len(outputs) == 1 and outputs[0].prompt == "prompt"
    assert outputs[0].outputs[0].text == TEXT[: TEXT.index("question") + len("question")]


def test_cumulative_and_delta_outputs_agree_with_decode(processor, smollm_tokenizer):
    text = "Café déjà vu 🌞 naïve"
    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    processor.add_request("c", None, [1], SamplingParams(), ["c"], 0.0)
    processor.add_request("d", None, [1], SamplingParams(output_kind=RequestOutputKind.DELTA), ["d"], 0.0)
    cumulative = feed(processor, "c", ids, finish_last="length")
    deltas = feed(processor, "d", ids, finish_last="length")
    last = cumulative[-1].request_outputs[0].outputs[0]
    assert last.text == smollm_tokenizer.decode(ids) and last.token_ids == ids
    assert last.finish_reason == "length"
    pieces = [o.outputs[0].text for r in deltas for o in r.request_outputs]
    assert "".join(pieces) == smollm_tokenizer.decode(ids)
    assert not any("\ufffd" in p for p in pieces)
    assert sum(len(o.outputs[0].token_ids) for r in deltas for o in r.request_outputs) == len(ids)


def test_n_sequences_make_one_request_output(processor, smollm_tokenizer):
    processor.add_request("p", None, [1], SamplingParams(n=2), ["p/0", "p/1"], 0.0)
    a, b = smollm_tokenizer.encode(" yes", add_special_tokens=False), smollm_tokenizer.encode(" no", add_special_tokens=False)
    first = processor.process_outputs(EngineCoreOutputs([EngineCoreOutput("p/0", a, finish_reason="length")]))
    (partial,) = first.request_outputs
    assert not partial.finished and [c.index for c in partial.outputs] == [0, 1]
    second = processor.process_outputs(EngineCoreOutputs([EngineCoreOutput("p/1", b, finish_reason="stop")]))
    (whole,) = second.request_outputs
    assert whole.finished and [c.text for c in whole.outputs] == [" yes", " no"]
    assert [c.finish_reason for c in whole.outputs] == ["length", "stop"]
    (finished,) = second.iteration_stats.finished_requests
    assert finished.finish_reasons == ["length", "stop"] and finished.num_generation_tokens == len(a) + len(b)


def test_abort_returns_the_unfinished_sequences(processor):
    processor.add_request("p", None, [1], SamplingParams(n=2, output_kind=RequestOutputKind.DELTA), ["p/0", "p/1"], 0.0)
    processor.process_outputs(EngineCoreOutputs([EngineCoreOutput("p/0", [42], finish_reason="stop")]))
    unfinished, last = processor.abort_request("p")
    assert unfinished == ["p/1"]
    assert last.finished and [c.finish_reason for c in last.outputs] == ["abort"]
    assert processor.abort_request("p") == ([], None)
