"""Embeddings through the engine's own seams: `LLM.embed` against transformers' final-norm hidden
states of tiny random models (last and mean pooling, prompts of different lengths batched together,
one longer than a chunked-prefill chunk, alongside generation), and POST /v1/embeddings with the
official `openai` client against a live server."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from live_server import ServerProcess
from support import EXACT, EXACT_FLAGS, tiny_hf_model
from tokenizers import Tokenizer

from roseinfer import LLM, PoolingParams, SamplingParams
from roseinfer.common import serial
from roseinfer.common.messages import EngineCoreRequest, ModelRunnerOutput
from roseinfer.errors import ContextLengthError, InvalidRequestError

CHUNK = 16  # max_num_batched_tokens: the 70-token prompt runs in 5 chunks
PROMPTS = [list(range(5, 8)), list(range(20, 50)), [(7 * i) % 300 + 3 for i in range(70)], [42]]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("embed") / request.param
    return path, tiny_hf_model(request.param, path)


def reference(model: torch.nn.Module, prompt: list[int], pooling: str, normalize: bool = True,
              dimensions: int | None = None) -> np.ndarray:
    """transformers' last hidden state (after the final norm: lm_head of it gives the logits),
    pooled, truncated and normalized."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_hidden_states=True)
    hidden = out.hidden_states[-1][0]
    torch.testing.assert_close(model.lm_head(hidden), out.logits[0])  # it is the final-norm output
    vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    vector = vector[:dimensions] if dimensions is not None else vector
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.numpy()


@pytest.fixture(scope="module")
def tiny_llm(tiny) -> LLM:
    path, _ = tiny
    return LLM(str(path), max_num_batched_tokens=CHUNK, num_kv_blocks=160, block_size=4, **EXACT)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embed_matches_transformers_batched_and_chunked(tiny, tiny_llm, pooling):
    _, model = tiny
    outputs = tiny_llm.embed(PROMPTS, PoolingParams(pooling_type=pooling), use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.finished and output.finish_reason == "stop" and output.outputs.data.dtype == np.float32
        np.testing.assert_allclose(output.outputs.data, reference(model, prompt, pooling), rtol=1e-4, atol=1e-5)
        assert abs(np.linalg.norm(output.outputs.data) - 1.0) < 1e-5
    engine = tiny_llm.llm_engine.engine_core
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks  # cached blocks count as free


def test_embed_raw_and_truncated(tiny, tiny_llm):
    _, model = tiny
    prompt = PROMPTS[2]
    raw, short = tiny_llm.embed([prompt, prompt], [PoolingParams("mean", normalize=False),
                                                  PoolingParams("last", dimensions=16)], use_tqdm=False)
    np.testing.assert_allclose(raw.outputs.data, reference(model, prompt, "mean", normalize=False), rtol=1e-4,
                               atol=1e-5)
    assert short.outputs.data.shape == (16,)
    np.testing.assert_allclose(short.outputs.data, reference(model, prompt, "last", dimensions=16), rtol=1e-4,
                               atol=1e-5)


def test_embed_beside_generation_and_from_the_prefix_cache(tiny, tiny_llm):
    """Embeddings and generation in the same steps both come out right; a prompt whose blocks
    are in the prefix cache (from the generation) embeds to the same vector."""
    _, model = tiny
    engine = tiny_llm.llm_engine
    prompt = PROMPTS[2]
    engine.add_request("gen", prompt, SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6, ignore_eos=True))
    engine.add_request("last", prompt, PoolingParams("last"))
    engine.add_request("mean", prompt, PoolingParams("mean"))
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    assert finals["gen"].outputs[0].token_ids == expected
    for pooling in ("last", "mean"):
        np.testing.assert_allclose(finals[pooling].outputs.data, reference(model, prompt, pooling), rtol=1e-4,
                                   atol=1e-5)
    again, mean = tiny_llm.embed([prompt, prompt], [PoolingParams("last"), PoolingParams("mean")], use_tqdm=False)
    assert again.metrics.num_cached_tokens > 0  # its full blocks came from the prefix cache
    np.testing.assert_allclose(again.outputs.data, reference(model, prompt, "last"), rtol=1e-4, atol=1e-5)
    assert mean.metrics.num_cached_tokens == 0  # mean pooling needs every token's hidden state
    np.testing.assert_allclose(mean.outputs.data, reference(model, prompt, "mean"), rtol=1e-4, atol=1e-5)


def test_mean_pooling_starts_over_after_a_preemption(tiny):
    """A mean-pooled prompt preempted halfway through its chunks (the KV pool runs out) is
    recomputed from its first token later, its sum started over: the vector is still right."""
    path, model = tiny
    llm = LLM(str(path), max_num_batched_tokens=CHUNK, num_kv_blocks=24, block_size=4, **EXACT)
    engine = llm.llm_engine
    generated = PROMPTS[1] + PROMPTS[1][:10]  # 40 tokens + 8 generated: 12 blocks
    pooled = [(5 * i) % 300 + 3 for i in range(60)]  # 15 blocks: both do not fit in 24
    engine.add_request("gen", generated, SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, ignore_eos=True))
    engine.add_request("mean", pooled, PoolingParams("mean"))
    finals = {}
    while engine.has_unfinished_requests():
        finals |= {output.request_id: output for output in engine.step() if output.finished}
    assert engine.engine_core.scheduler.stats.num_preemptions >= 1
    np.testing.assert_allclose(finals["mean"].outputs.data, reference(model, pooled, "mean"), rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        expected = model.generate(torch.tensor([generated]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                  pad_token_id=0)[0, len(generated):].tolist()
    assert finals["gen"].outputs[0].token_ids == expected
    assert engine.engine_core.kv_cache.num_free_blocks == 24


def test_pooling_messages_cross_processes():
    """What an engine-core process or a tensor-parallel worker receives and sends (msgpack)."""
    request = EngineCoreRequest("e", [5, 6, 7], None, [0], 1.0, pooling_params=PoolingParams("mean", False, 8))
    output = ModelRunnerOutput(pooled={"e": np.arange(4, dtype=np.float32)})
    again, output_again = serial.decode(serial.encode([request, output]))
    assert again == request and again.sampling_params is None
    np.testing.assert_array_equal(output_again.pooled["e"], output.pooled["e"])
    with pytest.raises(ValueError):  # one kind or the other, never both or neither
        EngineCoreRequest("x", [5], None, [0], 1.0)


def test_embed_checks_name_the_field(tiny_llm):
    hidden = tiny_llm.llm_engine.model_config.hidden_size
    with pytest.raises(InvalidRequestError) as caught:
        tiny_llm.embed("hello", PoolingParams(dimensions=hidden + 1), use_tqdm=False)
    assert caught.value.param == "dimensions"
    with pytest.raises(InvalidRequestError) as caught:
        PoolingParams(pooling_type="cls")
    assert caught.value.param == "pooling_type"
    with pytest.raises(ContextLengthError) as caught:
        tiny_llm.embed([[i % 300 + 3 for i in range(513)]], use_tqdm=False)  # longer than the context (512)
    assert caught.value.param == "prompt"


# -- the HTTP API --------------------------------------------------------------------------

KEY = "sesame"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("embed-server") / "llama"
    model = tiny_hf_model("llama", path)
    process = ServerProcess("--model", str(path), "--served-model-name", "tiny", "--api-key", KEY,
                            "--max-num-batched-tokens", str(CHUNK), "--disable-web-ui", *EXACT_FLAGS)
    yield process, model, path
    assert process.stop() == 0, process.output()


@pytest.fixture
def client(server) -> openai.OpenAI:
    process, *_ = server
    return openai.OpenAI(base_url=process.url + "/v1", api_key=KEY, max_retries=0)


def test_openai_client_float_base64_token_ids_and_dimensions(server, client):
    _, model, _ = server
    texts = ["The quick brown fox", "Paged attention keeps keys and values in fixed-size blocks. " * 3]
    floats = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    # Without encoding_format the client asks for base64 and decodes it itself.
    decoded = client.embeddings.create(model="tiny", input=texts)
    encoded = client.embeddings.create(model="tiny", input=texts, encoding_format="base64")
    ids = client.embeddings.create(model="tiny", input=PROMPTS[:3])
    short = client.embeddings.create(model="tiny", input=PROMPTS[2], dimensions=8)
    assert floats.model == "tiny" and floats.object == "list" and [d.index for d in floats.data] == [0, 1]
    for got, raw, want in zip(decoded.data, encoded.data, floats.data, strict=True):
        assert got.embedding == want.embedding  # base64 carries the same float32 values
        assert np.frombuffer(base64.b64decode(raw.embedding), dtype="<f4").tolist() == want.embedding
    for prompt, item in zip(PROMPTS[:3], ids.data, strict=True):
        np.testing.assert_allclose(item.embedding, reference(model, prompt, "last"), rtol=1e-4, atol=1e-5)
    assert ids.usage.prompt_tokens == ids.usage.total_tokens == sum(map(len, PROMPTS[:3]))
    np.testing.assert_allclose(short.data[0].embedding, reference(model, PROMPTS[2], "last", dimensions=8),
                               rtol=1e-4, atol=1e-5)
    assert floats.usage.prompt_tokens > len(texts)


def test_base64_is_little_endian_float32(server):
    process, model, _ = server
    body = httpx.post(process.url + "/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"},
                      json={"input": PROMPTS[1], "encoding_format": "base64", "user": "u-1"}).json()
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, reference(model, PROMPTS[1], "last"), rtol=1e-4, atol=1e-5)


def test_errors_in_openai_shape(server, client):
    process, *_ = server
    cases = [
        ({"input": "hi", "dimensions": 65}, "dimensions"),
        ({"input": "hi", "dimensions": 0}, "dimensions"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [""]}, "input"),
        ({"input": [1, 2, 100000]}, "input"),
        ({"input": [i % 300 + 3 for i in range(513)]}, "input"),  # longer than the context
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
        ({"input": ["hi"] * 129}, "input"),  # more than the queue holds (--max-queue-len: 2 x 64)
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.post("/embeddings", body=body, cast_to=httpx.Response)
        error = caught.value.body
        assert error["param"] == param and error["type"] == "invalid_request_error", (body, error)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="hi")
    unauthorized = httpx.post(process.url + "/v1/embeddings", json={"input": "hi"})
    assert unauthorized.status_code == 401 and unauthorized.json()["error"]["type"] == "authentication_error"
    schema = httpx.get(process.url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert "/v1/embeddings" in schema["paths"]


def test_embedding_and_generation_in_flight_together(server):
    process, model, path = server
    prompt = PROMPTS[2]
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()

    async def both():
        client = openai.AsyncOpenAI(base_url=process.url + "/v1", api_key=KEY, max_retries=0)
        return await asyncio.gather(
            client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True, "min_tokens": 8}),
            client.embeddings.create(model="tiny", input=[prompt, PROMPTS[1]]),
        )

    completion, embeddings = asyncio.run(both())
    assert completion.choices[0].text == Tokenizer.from_file(str(path / "tokenizer.json")).decode(expected)
    for item, source in zip(embeddings.data, [prompt, PROMPTS[1]], strict=True):
        np.testing.assert_allclose(item.embedding, reference(model, source, "last"), rtol=1e-4, atol=1e-5)
