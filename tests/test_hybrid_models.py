"""Hybrid models with recurrent layers (layers/recurrent/): tiny random Qwen3.5, Qwen3.5-MoE and
Qwen3-Next (Gated DeltaNet, models/qwen3_5.py), LFM2 (short convolutions, models/lfm2.py) and
Granite 4 and Nemotron-H (Mamba2, models/granite_hybrid.py, models/nemotron_h.py), built by transformers' own classes, saved as Hugging
Face directories and converted to GGUF by llama.cpp's own converter. roseinfer's greedy tokens
equal transformers' and its logits (teacher forced) are within float32 tolerance, from both files,
over batches of prompts of different lengths (one longer than a 64-token block of the chunked
prefill), with chunked prefill and with preemption; prompts repeated and extended under prefix
caching (state snapshots, tests/test_hybrid_prefix_cache.py) and n > 1 right, speculative decoding and tensor parallelism refused, a failed step's requests ended. The chunked delta rule against its token-by-token recurrence;
the state pools."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from engine_core_support import make_core, request
from hf_to_gguf import convert_hf_to_gguf, write_default_tokenizer
from support import EXACT, compare_logits_step_by_step

from roseinfer import LLM, SamplingParams
from roseinfer.errors import InvalidRequestError
from roseinfer.layers.recurrent import RECURRENCES, RecurrentStateSpec, StateTensorSpec
from roseinfer.layers.recurrent.gated_delta_net import (
    CHUNK,
    GatedDeltaNet,
    chunked_gated_delta_rule,
    recurrent_gated_delta_step,
)
from roseinfer.layers.recurrent.mamba2 import Mamba2Mixer
from roseinfer.layers.recurrent.short_conv import ShortConv
from roseinfer.worker.fault_injection import FAULT_TOKEN_ENV
from roseinfer.worker.state_pools import StatePools

TOKENS = 12
TOLERANCE = 1e-3  # float32 logits
# A one-token prompt (decoded from its first step), short ones, and one past two delta-rule blocks.
PROMPT_LENGTHS = (1, 7, 150, 40)
KINDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "lfm2", "granite", "nemotron_h")
# Nemotron-H's blocks: three Mamba2, two MLP (ReLU²), one attention (no rotary).
NEMOTRON_BLOCKS = "M-*M-M"


def _model(kind: str, vocab: int):
    import transformers

    common = dict(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=False, eos_token_id=0, bos_token_id=0, initializer_range=0.1,
    )
    experts = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2)
    if kind == "lfm2":  # three short-convolution layers, one attention layer
        config = {key: value for key, value in common.items() if not key.startswith(("linear_", "head_dim", "rms"))}
        return transformers.Lfm2ForCausalLM(transformers.Lfm2Config(
            **config, intermediate_size=192, norm_eps=1e-5, conv_L_cache=3, block_multiple_of=16, pad_token_id=0,
            layer_types=["conv", "conv", "full_attention", "conv"]))
    if kind.startswith("granite"):  # Granite 4: three Mamba2 layers, one attention layer (no rotary, as Granite 4's
        # hybrids), experts and a shared MLP, every multiplier away from 1
        return transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=32, shared_intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
            num_local_experts=0 if kind == "granite_dense" else 4, num_experts_per_tok=2, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16,
            mamba_d_head=16, mamba_expand=2, mamba_d_conv=4, layer_types=["mamba", "mamba", "attention", "mamba"],
            embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=3.0,
            eos_token_id=0, bos_token_id=0, pad_token_id=0, initializer_range=0.1, tie_word_embeddings=False))
    if kind == "nemotron_h":
        kinds = {"M": "mamba", "*": "attention", "-": "mlp"}
        return transformers.NemotronHForCausalLM(transformers.NemotronHConfig(
            vocab_size=vocab, hidden_size=64, layers_block_type=[kinds[block] for block in NEMOTRON_BLOCKS],
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8,
            mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, max_position_embeddings=512,
            layer_norm_epsilon=1e-5, eos_token_id=0, bos_token_id=0, pad_token_id=0, initializer_range=0.1,
            tie_word_embeddings=False))
    if kind == "qwen3_5":
        return transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(intermediate_size=96, **common))
    if kind == "qwen3_5_moe":
        return transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**common, **experts))
    return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(intermediate_size=96, **common, **experts))


class TinyHybrid:
    """A tiny random model of one family: transformers' model, its HF directory and GGUF file."""

    def __init__(self, kind: str, root: Path, gguf: bool = True) -> None:
        self.kind, self.hf_dir = kind, root / kind
        vocab = write_default_tokenizer(self.hf_dir)
        torch.manual_seed(0)
        self.reference = _model(kind, vocab).eval()
        with torch.no_grad():  # norms away from their initial values (Qwen's 1 + w offsets are checked)
            for name, param in self.reference.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0 if kind.startswith("qwen") else 1.0, 0.3)
                elif name.endswith(".D"):  # Mamba2's skip
                    param.normal_(1.0, 0.3)
                elif name.endswith(".dt_bias"):  # (Nemotron-H's initial steps sit at transformers'
                    # prefill-only floor, time_step_min, which its decode and roseinfer do not apply)
                    param.fill_(1.0)
        self.reference.save_pretrained(self.hf_dir)
        self.gguf = self._convert(root, kind) if gguf else None
        generator = torch.Generator().manual_seed(1)
        self.prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
        self.expected = [self._greedy(prompt) for prompt in self.prompts]

    def _convert(self, root: Path, kind: str) -> Path:
        source = self.hf_dir
        if kind.startswith("granite"):
            # transformers 5 writes Granite's layer types as linear_attention / full_attention; the
            # converter reads the published configs' spelling, mamba / attention.
            source = root / f"{kind}-for-converter"
            shutil.copytree(self.hf_dir, source)
            config = json.loads((source / "config.json").read_text())
            config["layer_types"] = ["mamba" if layer == "linear_attention" else "attention" for layer in config["layer_types"]]
            (source / "config.json").write_text(json.dumps(config))
        if kind == "nemotron_h":
            # The published configs spell the blocks as a pattern (transformers 5 writes a list the
            # converter reads as mixture-of-experts blocks) and carry no expert keys; transformers 5's
            # config class would add them back (the converter would write nemotron_h_moe), so, as for
            # Qwen3.5-MoE below, a model_type it does not know makes the converter read the file as is.
            source = root / f"{kind}-for-converter"
            shutil.copytree(self.hf_dir, source)
            config = json.loads((source / "config.json").read_text())
            config = {key: value for key, value in config.items()
                      if key != "layers_block_type" and not key.startswith(("num_experts", "n_routed", "moe_"))}
            config.update(hybrid_override_pattern=NEMOTRON_BLOCKS, num_hidden_layers=len(NEMOTRON_BLOCKS),
                          model_type="tiny_nemotron_h")
            (source / "config.json").write_text(json.dumps(config))
        if kind == "qwen3_5_moe":
            # transformers 5 gives a qwen3_5_moe_text directory Qwen's own tokenizer class whatever
            # tokenizer_config.json says, which the converter then fails to recognise (the files are
            # SmolLM2's borrowed tokenizer, see write_default_tokenizer). A model_type transformers
            # does not know makes both read the files as they are; the weights are the same.
            source = root / f"{kind}-for-converter"
            shutil.copytree(self.hf_dir, source)
            config = json.loads((source / "config.json").read_text())
            (source / "config.json").write_text(json.dumps({**config, "model_type": "tiny_" + config["model_type"]}))
        # The Qwen models transformers builds have no MTP layers: the converter must not look for them.
        options = ("--no-mtp",) if kind.startswith("qwen") else ()
        return convert_hf_to_gguf(source, root / f"{kind}.gguf", "f32", *options)

    @torch.no_grad()
    def _greedy(self, prompt: list[int]) -> list[int]:
        """transformers' greedy continuation (its own recurrent cache; end-of-text a token like any
        other): the same tokens as recomputing the whole sequence each step, in a fraction of the time."""
        self.reference.generation_config.eos_token_id = None
        ids = self.reference.generate(torch.tensor([prompt]), max_new_tokens=TOKENS, do_sample=False, pad_token_id=0)
        return ids[0, len(prompt):].tolist()


_BUILT: dict[str, TinyHybrid] = {}


@pytest.fixture(scope="module", params=KINDS)
def tiny_hybrid(request, tmp_path_factory) -> TinyHybrid:
    if request.param not in _BUILT:
        _BUILT[request.param] = TinyHybrid(request.param, tmp_path_factory.mktemp("hybrid"))
    return _BUILT[request.param]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_greedy_tokens_and_logits_match_transformers(tiny_hybrid, source):
    path = tiny_hybrid.hf_dir if source == "hf" else tiny_hybrid.gguf
    llm = LLM(str(path), dtype="float32", **EXACT)
    recurrent = [m for m in llm.llm_engine.model_runner.model.modules() if type(m) in RECURRENCES.values()]
    kind = {"lfm2": ShortConv, "granite": Mamba2Mixer, "nemotron_h": Mamba2Mixer}.get(tiny_hybrid.kind, GatedDeltaNet)
    assert len(recurrent) == 3 and all(isinstance(layer, kind) for layer in recurrent)
    assert _greedy(llm, tiny_hybrid.prompts) == tiny_hybrid.expected
    worst = compare_logits_step_by_step(llm.engine, tiny_hybrid.reference, tiny_hybrid.prompts, 2)
    assert worst < TOLERANCE, f"max |logit difference| {worst}"


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_chunked_prefill_and_preemption(tiny_hybrid, source):
    """Prompts prefilled 32 tokens a step (the state carried from chunk to chunk, mixed with other
    requests' decodes), in a pool too small for all of them: requests are preempted and computed
    again from the start, and every answer is still transformers'."""
    path = tiny_hybrid.hf_dir if source == "hf" else tiny_hybrid.gguf
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=32, num_kv_blocks=14, **EXACT)
    assert _greedy(llm, tiny_hybrid.prompts) == tiny_hybrid.expected
    assert llm.llm_engine.scheduler.stats.num_preemptions > 0


def test_prefix_caching_keeps_snapshots_and_repeated_prompts_stay_right(tiny_hybrid, caplog):
    """A cached prefix's blocks cannot give a recurrent layer its state: the prefix cache keeps
    state snapshots at block boundaries (saying how many), and a prompt asked again, alone,
    extended or with n > 1, is answered right."""
    with caplog.at_level(logging.INFO, logger="roseinfer"):
        llm = LLM(str(tiny_hybrid.hf_dir), dtype="float32", enable_prefix_caching=True, **EXACT)
    assert "snapshots of the recurrent state" in caplog.text
    long_prompt, expected = tiny_hybrid.prompts[2], tiny_hybrid.expected[2]
    assert _greedy(llm, [long_prompt]) == [expected]
    assert _greedy(llm, [long_prompt]) == [expected]
    extended = long_prompt + expected[:4]
    assert _greedy(llm, [extended])[0][: TOKENS - 4] == expected[4:]
    # n > 1: each sequence computes the prompt itself (the first one's state is not in its blocks).
    params = SamplingParams(temperature=0.0, n=2, max_tokens=TOKENS, ignore_eos=True)
    group = llm.generate(prompt_token_ids=[long_prompt], sampling_params=params, use_tqdm=False)[0]
    assert [list(sequence.token_ids) for sequence in group.outputs] == [expected, expected]


def test_speculative_decoding_and_tensor_parallelism_are_refused(tiny_hybrid):
    if tiny_hybrid.kind != KINDS[0]:
        pytest.skip("one family is enough")
    with pytest.raises(InvalidRequestError, match="roll back"):
        LLM(str(tiny_hybrid.hf_dir), **EXACT, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(InvalidRequestError, match="tensor parallelism"):
        LLM(str(tiny_hybrid.hf_dir), **EXACT, tensor_parallel_size=2)


def test_a_failed_step_ends_its_requests_and_the_engine_goes_on(tiny_hybrid, monkeypatch):
    """A step that fails is not run again in parts on a hybrid model (its recurrent states may
    already have moved on): the step's requests end with an error, and the next requests are exact."""
    if tiny_hybrid.kind != KINDS[0]:
        pytest.skip("one family is enough")
    monkeypatch.setenv(FAULT_TOKEN_ENV, "2")  # no prompt here holds token 2 but this one
    core = make_core(tiny_hybrid.hf_dir, dtype="float32", quantization="none")
    core.add_request(request("faulty", [5, 2, 9]))
    core.add_request(request("beside", tiny_hybrid.prompts[1]))
    outputs = core.step().outputs
    assert sorted((o.request_id, o.finish_reason) for o in outputs) == [("beside", "error"), ("faulty", "error")]
    assert "injected fault" in outputs[0].error
    core.add_request(request("after", tiny_hybrid.prompts[2], max_tokens=TOKENS))
    tokens: list[int] = []
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            tokens += output.new_token_ids
    assert tokens == tiny_hybrid.expected[2]


def test_granite_without_experts(tmp_path):
    """A Granite 4 hybrid without experts (as granite-4.0-h-micro: each layer's MLP is its shared
    SwiGLU alone, which llama.cpp's converter writes as the plain FFN): transformers' greedy tokens
    from the Hugging Face directory and from the GGUF file."""
    built = TinyHybrid("granite_dense", tmp_path)
    for path in (built.hf_dir, built.gguf):
        llm = LLM(str(path), dtype="float32", max_num_batched_tokens=32, **EXACT)
        assert _greedy(llm, built.prompts) == built.expected


def test_a_multimodal_checkpoint_runs_its_language_model(tmp_path):
    """Qwen3.5 as published (Qwen3_5ForConditionalGeneration: the text config nested, the language
    model's tensors under model.language_model., a vision tower beside it): the text model runs."""
    import transformers

    vocab = write_default_tokenizer(tmp_path)
    text = _model("qwen3_5", vocab).config.to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                  num_position_embeddings=16)
    torch.manual_seed(0)
    reference = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    reference.save_pretrained(tmp_path)
    prompt = torch.randint(3, vocab, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(4):
            ids = torch.cat([ids, reference(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    output = LLM(str(tmp_path), dtype="float32", **EXACT).generate(
        prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == ids[0, len(prompt):].tolist()


def test_chunked_delta_rule_equals_the_token_by_token_recurrence():
    """Blocks of 64 (with padding past the end, and from a non-zero state) against one token at a
    time, outputs and final state."""
    torch.manual_seed(0)
    batch, heads, length, dk, dv = 2, 3, 150, 8, 4
    padded = -(-length // CHUNK) * CHUNK
    q = torch.nn.functional.normalize(torch.randn(batch, heads, padded, dk), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(batch, heads, padded, dk), dim=-1)
    v = torch.randn(batch, heads, padded, dv)
    g, beta = -torch.rand(batch, heads, padded), torch.rand(batch, heads, padded)
    g[..., length:], beta[..., length:] = 0.0, 0.0  # padding
    start = torch.randn(batch, heads, dk, dv)
    out, final = chunked_gated_delta_rule(q, k, v, g, beta, start)
    state, steps = start, []
    for t in range(length):
        o, state = recurrent_gated_delta_step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t], state)
        steps.append(o)
    torch.testing.assert_close(out[:, :, :length], torch.stack(steps, dim=2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, state, atol=1e-5, rtol=1e-5)


def test_state_pools_hold_each_tensor_per_slot_and_zero_a_starting_sequence():
    """The runner's state pools (worker/state_pools.py; the KV coordinator hands out the slots):
    each tensor of the spec per layer, in its own dtype; zeroing a slot (a sequence that starts at
    position 0) leaves the other slots' state."""
    spec = RecurrentStateSpec("gated_delta_net", (0, 2), (StateTensorSpec("conv", (3, 8)),
                                                          StateTensorSpec("recurrent", (2, 4, 4), "float32")))
    pools = StatePools(spec, 3, torch.bfloat16, torch.device("cpu"))
    assert [tensor.dtype for tensor in pools.pools[0]] == [torch.bfloat16, torch.float32]
    assert [tuple(tensor.shape) for tensor in pools.pools[2]] == [(3, 3, 8), (3, 2, 4, 4)]
    for tensors in pools.pools.values():
        for tensor in tensors:
            tensor.fill_(1.0)
    pools.zero([1])
    for tensors in pools.pools.values():
        for tensor in tensors:
            assert tensor.flatten(1).float().mean(1).tolist() == [1.0, 0.0, 1.0]
    assert spec.slot_bytes(torch.bfloat16) == 2 * (3 * 8 * 2 + 2 * 4 * 4 * 4)
