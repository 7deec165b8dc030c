"""The C++ decode step (models/fused_decode.py) against the op-by-op forward it replaces: the same
logits on tiny random Llama, Qwen2 (q/k/v biases) and Qwen3 (q/k norms) models and the same
next-token distributions on the default model, with GGUF blocks (the default model's own Q4_1 / Q8_0, and int4 / int8) and
with float32 and bfloat16 weights on the panel kernel. (Gemma 2 and 3 through the same step: test_gemma.py.)"""

from __future__ import annotations

import pytest
import torch
from support import tiny_hf_model

from roseinfer import LLM, InferenceEngine, SamplingParams
from roseinfer.common.messages import ModelRunnerOutput
from roseinfer.layers.cpu_kernels import cpu_kernels
from roseinfer.models.fused_decode import PostNorms, fused_decoder_for, unsupported
from roseinfer.models.llama import LlamaForCausalLM


def decode_logits_both_ways(engine: InferenceEngine, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """Run the prompts and `steps` decode steps; at each decode step compare the fused decoder's
    logits with the op-by-op forward's for the same batch. Returns the largest difference, and the
    largest KL divergence of a row's next-token distribution (nats)."""
    runner = engine.runner
    fused = runner.fused_decoder
    assert fused is not None
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    ids = [engine.add_request(None, params, prompt_token_ids=p) for p in prompts]
    worst = worst_kl = 0.0
    try:
        engine.step()  # the prompts
        for _ in range(steps):
            scheduler = engine.scheduler
            step = scheduler.schedule()
            runner.fused_decoder = None
            reference, req_ids = runner.compute_logits(step)  # op by op (updates the runner's state)
            inputs = runner.prepare_inputs(type(step)(num_scheduled_tokens=step.num_scheduled_tokens))
            meta = inputs.meta
            groups = list(meta.groups.values()) or [meta]  # KV cache groups (Gemma: full and sliding layers)
            logits = fused.forward(inputs.input_ids, inputs.positions, [g.slot_mapping for g in groups],
                                   [g.decode_block_tables for g in groups], meta.decode_context_lens,
                                   runner.kv_caches, meta.long_rope)
            assert logits.dtype == reference.dtype and logits.shape == reference.shape
            logits, reference = logits.float(), reference.float()
            worst = max(worst, (logits - reference).abs().max().item())
            kl = torch.nn.functional.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                                            reduction="none").sum(-1)
            worst_kl = max(worst_kl, kl.max().item())
            runner.fused_decoder = fused
            tokens = [[int(t)] for t in reference.argmax(-1)]
            scheduler.update_from_output(step, ModelRunnerOutput(req_ids, tokens))
    finally:
        runner.fused_decoder = fused
        for request_id in ids:
            engine.abort_request(request_id)
    return worst, worst_kl


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_fused_decode_logits_equal_the_op_by_op_forward(kind, quantization, tmp_path):
    tiny_hf_model(kind, tmp_path / kind)
    engine = InferenceEngine(str(tmp_path / kind), num_kv_blocks=64, quantization=quantization)
    worst, worst_kl = decode_logits_both_ways(engine, [[5, 9, 30, 31, 200], [7] * 20, list(range(40, 77))], steps=6)
    if quantizes_activations():
        # 8-bit activations: a last-bit difference between the two paths' sums (Qwen3's q/k norms
        # run in PyTorch op by op) can move a value across a rounding step. See the next test.
        assert worst_kl < 1e-3, (worst, worst_kl)
    else:
        assert worst < 1e-4, worst


def quantizes_activations() -> bool:
    """Whether small batches' activations are rounded to 8 bits (VNNI builds of the block kernels)."""
    return cpu_kernels().gguf_kernel_isa() == "avx512-vnni"


def panel_dtypes() -> list[str]:
    kernels = cpu_kernels()
    return kernels.panel_linear_dtypes() if kernels is not None else []


# More rows than one parallel task of the elementwise passes takes (16), of different lengths.
MANY_PROMPTS = [[(7 * i + j) % 200 + 1 for j in range(3 + i)] for i in range(24)]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_on_the_panel_kernel_equals_the_op_by_op_forward(kind, dtype, tmp_path):
    """`--quantization none` on CPUs with the panel kernel: both paths call the same linear kernel,
    attention and row functions, so the logits are the same, but for Qwen3, whose q/k norms run in
    PyTorch op by op (their sums in another order; in bfloat16 a value may round the other way)."""
    if dtype not in panel_dtypes():
        pytest.skip(f"this CPU's build has no {dtype} panel kernel (it has AMX, or no AVX-512): oneDNN layers")
    tiny_hf_model(kind, tmp_path / kind)
    engine = InferenceEngine(str(tmp_path / kind), num_kv_blocks=128, dtype=dtype)
    worst, worst_kl = decode_logits_both_ways(engine, MANY_PROMPTS, steps=5)
    if kind != "qwen3":
        assert worst == 0.0, worst
    elif dtype == "float32":
        assert worst < 1e-4, worst
    else:
        assert worst_kl < 1e-3, (worst, worst_kl)


@pytest.mark.parametrize(("quantization", "dtype"), [
    ("auto", "float32"), ("int4", "float32"), ("none", "float32"), ("none", "bfloat16"),
])
def test_default_model_next_token_distributions_with_and_without_the_fused_decoder(
    quantization, dtype, chat_prompt_ids
):
    """On the 30-layer default model the two paths' float sums differ in the last bits; where the
    kernels quantize activations to 8 bits (VNNI) such a difference can move a value across a
    rounding step, so the comparison is of distributions (KL, nats), not of exact logits. The bound
    is a tenth of a nat for the worst row, 30x the mean KL of int4 from float32 (bench quality).
    Float weights on the panel kernel: the same kernels in the same order both ways, the same logits."""
    if quantization == "none" and dtype not in panel_dtypes():
        pytest.skip(f"this CPU's build has no {dtype} panel kernel: no fused decoder for float weights")
    llm = LLM(quantization=quantization, dtype=dtype, kv_cache_memory=0.25)
    assert llm.llm_engine.model_runner.fused_decoder is not None
    worst, worst_kl = decode_logits_both_ways(llm.engine, chat_prompt_ids[:4], steps=8)
    assert worst_kl < 0.1, (worst, worst_kl)
    if quantization == "none":
        assert worst == 0.0, worst
    elif not quantizes_activations():
        assert worst < 1e-3, worst


def test_no_fused_decoder_where_it_does_not_apply(tmp_path):
    tiny_hf_model("gpt2", tmp_path / "gpt2")
    engine = InferenceEngine(str(tmp_path / "gpt2"), num_kv_blocks=16)
    assert engine.runner.fused_decoder is None  # GPT-2: the op-by-op path
    assert not hasattr(engine.runner.model, "fused_decode_spec")  # it describes no fused step


def test_the_fused_step_is_built_from_the_models_description(tmp_path):
    """The description holds the model's own modules and tensors (no copies, nothing read from
    elsewhere), one entry per layer with the layer's attention parameters."""
    tiny_hf_model("qwen3", tmp_path / "qwen3")
    engine = InferenceEngine(str(tmp_path / "qwen3"), num_kv_blocks=16, quantization="int8")
    model = engine.runner.model
    spec = model.fused_decode_spec()
    assert len(spec.layers) == len(model.model.layers)
    for described, layer in zip(spec.layers, model.model.layers, strict=True):
        assert described.qkv_proj is layer.self_attn.qkv_proj and described.mlp.down_proj is layer.mlp.down_proj
        assert described.input_norm.data_ptr() == layer.input_layernorm.weight.data_ptr()
        assert described.qk_norm.q.data_ptr() == layer.self_attn.q_norm.weight.data_ptr()
        assert not described.qk_norm.over_all_heads and described.post_norms is None
        assert described.attention is layer.self_attn.attn.params
        assert described.mlp.activation == "silu" and described.rotary is model.rotary
    assert spec.lm_head is model.lm_head and spec.embedding is model.model.embed_tokens
    assert unsupported(spec, torch.float32) is None and engine.runner.fused_decoder is not None


def test_what_the_description_says_and_the_step_cannot_compute_is_refused_by_name(tmp_path, caplog):
    """Each feature of a description that the C++ step does not compute (another activation,
    shapes or norm eps differing between layers, no positive scale) is refused with a reason naming
    it, logged once; what the step computes per layer (Gemma's features, an MLP of its own width)
    is not; and a subclass that changes the forward without describing itself does not inherit
    Llama's description."""
    import dataclasses
    import logging

    tiny_hf_model("llama", tmp_path / "llama")
    engine = InferenceEngine(str(tmp_path / "llama"), num_kv_blocks=16, quantization="int8")
    model = engine.runner.model
    spec = model.fused_decode_spec()
    first = spec.layers[0]

    def with_layer(index=0, **changes):
        layers = list(spec.layers)
        layers[index] = dataclasses.replace(layers[index], **changes)
        return dataclasses.replace(spec, layers=tuple(layers))

    refusals = {
        "layer 0: activation 'relu'": with_layer(mlp=dataclasses.replace(first.mlp, activation="relu")),
        "layer 1: its shapes differ from layer 0's": with_layer(
            1, attention=dataclasses.replace(first.attention, num_heads=2 * first.attention.num_heads)),
        "layer 1: its norms' eps differs from the final norm's": with_layer(1, norm_eps=2 * first.norm_eps),
        "layer 0: attention scale 0.0": with_layer(attention=dataclasses.replace(first.attention, scale=0.0)),
    }
    for reason, described in refusals.items():
        assert reason in (unsupported(described, torch.float32) or ""), reason
    # What Gemma adds is computed, per layer or per model: not refused.
    gemma_like = with_layer(1, mlp=dataclasses.replace(first.mlp, activation="gelu_tanh"),
                            post_norms=PostNorms(first.mlp_norm, first.mlp_norm),
                            attention=dataclasses.replace(first.attention, scale=0.1, softcap=50.0, sliding_window=8))
    assert unsupported(dataclasses.replace(gemma_like, embedding_scale=8.0, final_logit_softcap=30.0),
                       torch.float32) is None

    class Scaled(LlamaForCausalLM):  # a forward of its own, no description of it
        def forward(self, *args):
            return super().forward(*args) * 2

    model.__class__ = Scaled
    try:
        assert model.fused_decode_spec() is None
        with caplog.at_level(logging.INFO, logger="roseinfer.models.fused_decode"):
            for _ in range(2):
                assert fused_decoder_for(model, engine.runner.dtype, engine.runner.device) is None
        logged = [r.getMessage() for r in caplog.records if "no fused C++ decode step for Scaled" in r.getMessage()]
        assert logged == ["no fused C++ decode step for Scaled: the model describes no fused decode step; "
                          "decoding op by op"]
    finally:
        model.__class__ = LlamaForCausalLM


@pytest.mark.parametrize(("kind", "kv_cache_dtype", "pool_dtype"), [
    ("llama", "bfloat16", torch.bfloat16), ("qwen3", "q8_0", torch.int8),  # q8_0 wants heads of 32
])
def test_fused_decode_over_a_narrower_kv_cache(tmp_path, kind, kv_cache_dtype, pool_dtype):
    """--kv-cache-dtype bfloat16 or q8_0: the C++ step writes and reads the pool as the op-by-op
    forward does (same rounding, or quantization, of keys and values)."""
    tiny_hf_model(kind, tmp_path / kind)
    engine = InferenceEngine(str(tmp_path / kind), num_kv_blocks=64, quantization="int8", kv_cache_dtype=kv_cache_dtype)
    assert engine.runner.kv_caches[0].dtype == pool_dtype
    worst, worst_kl = decode_logits_both_ways(engine, [[5, 9, 30, 31, 200], [7] * 20, list(range(40, 77))], steps=6)
    if quantizes_activations():
        assert worst_kl < 1e-3, (worst, worst_kl)
    else:
        assert worst < 1e-4, worst
