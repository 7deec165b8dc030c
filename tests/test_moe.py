"""Mixture-of-experts models (models/moe.py): tiny random Qwen3-MoE, Qwen2-MoE (shared expert),
OLMoE and Mixtral built by transformers' own classes, saved as Hugging Face directories and converted
to GGUF by llama.cpp's own converter; roseinfer's greedy tokens equal transformers' float32 ones
and its logits are within float32 tolerance, from both files; with chunked prefill, preemption and
prefix caching; and on two tensor-parallel ranks as on one."""

from pathlib import Path

import pytest
import torch
from hf_to_gguf import convert_hf_to_gguf, write_default_tokenizer
from support import EXACT, compare_logits_step_by_step
from test_fused_decode import decode_logits_both_ways

from roseinfer import LLM, SamplingParams
from roseinfer.errors import InvalidRequestError
from roseinfer.layers.cpu_kernels import cpu_kernels
from roseinfer.models.moe import SparseMoeBlock

TOKENS = 32
TOLERANCE = 1e-3  # float32 logits
# Four prompts of different lengths (one past a KV block, one a single token).
PROMPT_LENGTHS = (1, 5, 19, 40)


def _config(kind: str, vocab: int):
    import transformers

    common = dict(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=0, bos_token_id=0,
    )
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
            intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, head_dim=16, rope_theta=1000000.0, **common)
    if kind == "qwen3_moe_dense":  # its second layer a dense MLP (mlp_only_layers)
        model_class, config = _config("qwen3_moe", vocab)
        config.mlp_only_layers = [1]
        return model_class, config
    if kind == "qwen2_moe":  # a shared expert behind a sigmoid gate; top-k weights not renormalised
        return transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(
            # Expert widths of two Q8_0 blocks: two ranks each take whole blocks of every down projection.
            intermediate_size=96, moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=6,
            num_experts_per_tok=2, norm_topk_prob=False, rope_theta=1000000.0, **common)
    if kind == "olmoe":  # q/k norms over all heads; top-k weights not renormalised
        return transformers.OlmoeForCausalLM, transformers.OlmoeConfig(
            intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, **common)
    if kind == "mixtral":
        return transformers.MixtralForCausalLM, transformers.MixtralConfig(
            intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, **common)
    raise ValueError(kind)


class TinyMoe:
    """A tiny random model of one kind: its transformers reference, HF directory and GGUF file
    (float32, or Q8_0 blocks; none where `outtype` is None)."""

    def __init__(self, kind: str, root: Path, outtype: str | None = "f32") -> None:
        self.hf_dir = root / kind
        vocab = write_default_tokenizer(self.hf_dir)
        model_class, config = _config(kind, vocab)
        config.initializer_range = 0.1  # larger weights than the default: logits that differ more
        torch.manual_seed(0)
        self.reference = model_class(config).eval()
        self.reference.save_pretrained(self.hf_dir)
        self.gguf = outtype and convert_hf_to_gguf(self.hf_dir, root / f"{kind}-{outtype}.gguf", outtype)
        generator = torch.Generator().manual_seed(1)
        self.prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
        self.expected = [self._greedy(prompt) for prompt in self.prompts]

    @torch.no_grad()
    def _greedy(self, prompt: list[int]) -> list[int]:
        """transformers' greedy continuation, end-of-text included like any other token."""
        ids = torch.tensor([prompt])
        for _ in range(TOKENS):
            ids = torch.cat([ids, self.reference(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return ids[0, len(prompt):].tolist()


# Each conversion takes a while on a loaded machine: one file per kind, Qwen2-MoE's in Q8_0 blocks
# (the model with a dense layer: its HF directory only).
OUTTYPES = {"qwen3_moe": "f32", "olmoe": "f32", "mixtral": "f32", "qwen2_moe": "q8_0", "qwen3_moe_dense": None}
_BUILT: dict[str, TinyMoe] = {}


def built(kind: str, tmp_path_factory) -> TinyMoe:
    if kind not in _BUILT:
        _BUILT[kind] = TinyMoe(kind, tmp_path_factory.mktemp("moe"), OUTTYPES[kind])
    return _BUILT[kind]


@pytest.fixture(scope="module", params=[kind for kind, outtype in OUTTYPES.items() if outtype == "f32"])
def tiny_moe(request, tmp_path_factory) -> TinyMoe:
    return built(request.param, tmp_path_factory)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_greedy_tokens_and_logits_match_transformers(tiny_moe, source):
    path = tiny_moe.hf_dir if source == "hf" else tiny_moe.gguf
    llm = LLM(str(path), num_kv_blocks=64, **EXACT)
    model = llm.llm_engine.model_runner.model
    assert any(isinstance(m, SparseMoeBlock) for m in model.modules())
    assert _greedy(llm, tiny_moe.prompts) == tiny_moe.expected
    worst = compare_logits_step_by_step(llm.engine, tiny_moe.reference, tiny_moe.prompts, 3)
    assert worst < TOLERANCE, f"max |logit difference| {worst}"
    # The decode steps above ran in the fused C++ step, router and experts included.
    assert llm.llm_engine.model_runner.fused_decoder is not None


@pytest.mark.parametrize("kind", ["qwen3_moe", "olmoe", "mixtral", "qwen2_moe"])
def test_the_fused_decode_step_equals_the_op_by_op_forward(kind, tmp_path_factory):
    """The C++ step's router, top-k, experts (and Qwen2-MoE's shared expert, OLMoE's q/k norms over
    all heads) against SparseMoeBlock's forward, at every decode step of a batch whose rows share
    experts: on float32 weights (panels) and on 8-bit blocks (Qwen2-MoE's own Q8_0 file, int8)."""
    moe = built(kind, tmp_path_factory)
    prompts = [[5, 9, 30, 31, 200], [7] * 20, list(range(40, 77)), [11, 12]]
    exact = LLM(str(moe.hf_dir), num_kv_blocks=64, **EXACT)
    worst, _ = decode_logits_both_ways(exact.engine, prompts, steps=6)
    assert worst < 1e-4, worst
    blocks = LLM(str(moe.gguf), num_kv_blocks=64) if kind == "qwen2_moe" else \
        LLM(str(moe.hf_dir), num_kv_blocks=64, quantization="int8")
    worst, worst_kl = decode_logits_both_ways(blocks.engine, prompts, steps=6)
    assert worst_kl < 1e-3, (worst, worst_kl)


def test_the_fused_decode_step_on_bfloat16_activations_equals_the_op_by_op_forward(tmp_path_factory):
    """The C++ step's grouped experts with bfloat16 activations (converted to float32 once for all
    the experts' 8-bit products) against the op-by-op forward, rows sharing experts."""
    moe = built("olmoe", tmp_path_factory)
    prompts = [[5, 9, 30, 31, 200], [7] * 20, list(range(40, 77)), [11, 12]]
    blocks = LLM(str(moe.hf_dir), num_kv_blocks=64, quantization="int8", dtype="bfloat16")
    assert blocks.llm_engine.model_runner.fused_decoder is not None
    worst, worst_kl = decode_logits_both_ways(blocks.engine, prompts, steps=6)
    assert worst_kl < 1e-3, (worst, worst_kl)


def test_shared_expert_from_hf_and_from_q8_0_blocks(tmp_path_factory):
    """Qwen2-MoE (a shared expert behind a sigmoid gate): exact from its HF directory; from a Q8_0
    GGUF every expert runs its own slice of the file's 3-D blocks (no float copy) with logits close
    to the float32 model's."""
    from roseinfer.layers.linear import BlockLinear

    moe = built("qwen2_moe", tmp_path_factory)
    llm = LLM(str(moe.hf_dir), num_kv_blocks=64, **EXACT)
    assert _greedy(llm, moe.prompts) == moe.expected
    assert compare_logits_step_by_step(llm.engine, moe.reference, moe.prompts, 3) < TOLERANCE

    llm = LLM(str(moe.gguf), num_kv_blocks=64)
    model = llm.llm_engine.model_runner.model
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    experts = [expert for block in blocks for expert in block.experts]
    assert experts and all(isinstance(e.gate_up_proj, BlockLinear) and isinstance(e.down_proj, BlockLinear)
                           for e in experts)
    assert all(block.shared_expert is not None for block in blocks)
    # One token (a decode step's row) runs exactly the experts its router chose, no others.
    ran: list[int] = []
    for index, expert in enumerate(blocks[0].experts):
        expert.register_forward_hook(lambda *_, index=index: ran.append(index))
    x = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    _, chosen = blocks[0].route(x)
    blocks[0](x)
    assert sorted(ran) == sorted(chosen[0].tolist()) and len(ran) == model.config.moe.top_k
    worst = compare_logits_step_by_step(llm.engine, moe.reference, moe.prompts, 3)
    assert worst < 0.1, f"max |logit difference| {worst}"


def test_chunked_prefill_and_preemption_give_the_same_tokens(tmp_path_factory):
    moe = built("qwen3_moe", tmp_path_factory)
    # A 16-token budget splits every longer prompt into chunks mixed with other requests' decodes,
    # and a pool of 12 blocks of 16 cannot hold the four requests at full length together.
    llm = LLM(str(moe.gguf), num_kv_blocks=12, max_num_batched_tokens=16, max_num_seqs=4, **EXACT)
    assert _greedy(llm, moe.prompts) == moe.expected
    engine = llm.llm_engine
    assert engine.scheduler.stats.num_preemptions > 0, "the pool was meant to be too small"
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_prefix_caching_gives_the_same_tokens(tmp_path_factory):
    """A prompt sent again reads its cached blocks (all but the last) and continues as before."""
    moe = built("qwen3_moe", tmp_path_factory)
    llm = LLM(str(moe.hf_dir), num_kv_blocks=64, block_size=16, enable_prefix_caching=True, **EXACT)
    stats = llm.llm_engine.kv_cache.prefix_stats
    prompt, expected = moe.prompts[3], moe.expected[3]  # 40 tokens: two full blocks
    assert _greedy(llm, [prompt]) == [expected]
    hits = stats.hits
    assert _greedy(llm, [prompt]) == [expected]
    assert stats.hits - hits >= 32


# Qwen2-MoE: a shared expert and q/k/v biases, from its HF directory and from Q8_0 blocks (each rank
# a column slice of every expert's down blocks); OLMoE: q/k norms over the heads of both ranks;
# Qwen3-MoE with a dense layer between MoE ones.
@pytest.mark.parametrize(("kind", "source"), [("qwen2_moe", "hf"), ("qwen2_moe", "gguf"),
                                              ("olmoe", "hf"), ("olmoe", "gguf"), ("qwen3_moe_dense", "hf")])
def test_two_ranks_match_one(tmp_path_factory, kind, source):
    """Every sampled row's logits (prefill in chunks mixed with decodes) within 1e-4 of one rank's,
    the same greedy tokens, and after preemption in a pool too small for all four prompts too."""
    from test_tensor_parallel import compare_logits, engine_config, generate, make_core

    from roseinfer.core.engine_core import EngineCore

    moe = built(kind, tmp_path_factory)
    path = moe.hf_dir if source == "hf" else moe.gguf
    # The HF directory's float32 weights multiplied exactly; the GGUF file's blocks run as they are.
    weights = EXACT if source == "hf" else {}
    reference = make_core(path, **weights)
    tp_core = make_core(path, tensor_parallel_size=2, **weights)
    try:
        executor = tp_core.executor
        assert [s["kv_heads"] for s in executor.collective_rpc("cache_state")] == [1, 1]
        assert compare_logits(reference, executor, moe.prompts, max_tokens=4) < 1e-4
        expected = generate(reference, moe.prompts, 8, "one")
        assert generate(tp_core, moe.prompts, 8, "two") == expected
        if source == "hf":  # transformers' tokens
            assert [expected[f"-{i}"] for i in range(len(moe.prompts))] == [t[:8] for t in moe.expected]
        # 16 blocks of 4: not enough for the 40-token prompt and the others at once.
        tight = EngineCore(*engine_config(path, num_kv_blocks=16, **weights), executor=executor)
        assert generate(tight, moe.prompts, 8, "tight") == expected
        assert tight.scheduler.stats.num_preemptions > 0
        assert tight.kv_cache.num_free_blocks == tight.kv_cache.num_blocks
    finally:
        tp_core.shutdown()


def test_more_ranks_than_an_expert_has_columns_is_refused(tmp_path_factory):
    moe = built("qwen3_moe", tmp_path_factory)
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size 64 is more than the expert FFN width 32"):
        LLM(str(moe.hf_dir), tensor_parallel_size=64)


def test_stacked_expert_tensors_load(tmp_path_factory, tmp_path):
    """transformers 5 holds each layer's experts as two 3-D tensors (`mlp.experts.gate_up_proj`
    [experts, 2 x width, hidden], `mlp.experts.down_proj`); a checkpoint saved from that state dict
    loads as the per-expert one does."""
    import shutil

    from safetensors.torch import save_file

    moe = built("mixtral", tmp_path_factory)
    state = {name: tensor.contiguous() for name, tensor in moe.reference.state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    shutil.copytree(moe.hf_dir, tmp_path / "stacked")
    save_file(state, tmp_path / "stacked" / "model.safetensors")
    llm = LLM(str(tmp_path / "stacked"), num_kv_blocks=64, **EXACT)
    assert _greedy(llm, moe.prompts) == moe.expected


def _with_mxfp4_experts(source: Path, output: Path, expanded: bool) -> Path:
    """A copy of a GGUF file whose 3-D expert tensors (`ffn_*_exps`) are MXFP4, quantized by
    gguf-py, as `llama-quantize ... MXFP4_MOE` keeps them (everything else as it was); with
    `expanded`, those tensors as F32 of gguf's own MXFP4 values instead."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize, quantize

    reader = GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(output), arch=arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub_type)
    mxfp4 = GGMLQuantizationType.MXFP4
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        if "_exps." in tensor.name:
            assert tensor.tensor_type == GGMLQuantizationType.F32 and data.ndim == 3  # [experts, rows, columns]
            blocks = quantize(data, mxfp4)
            if expanded:
                writer.add_tensor(tensor.name, dequantize(blocks, mxfp4).astype(np.float32))
            else:
                writer.add_tensor(tensor.name, blocks, raw_dtype=mxfp4)
        else:
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return output


def test_experts_in_mxfp4_blocks(tmp_path_factory):
    """Experts in MXFP4 (gpt-oss's type; files from `llama-quantize ... MXFP4_MOE`): exact
    (--quantization none), the same tokens and log-probabilities as the same file with those experts
    written as F32 of gguf's own MXFP4 values; in their own blocks, the fused step's grouped expert
    products (all chosen experts' MXFP4 products in one parallel region) equal the op-by-op forward's
    expert by expert."""
    from gguf import GGMLQuantizationType

    moe = built("qwen3_moe", tmp_path_factory)
    root = tmp_path_factory.mktemp("mxfp4")
    blocks = _with_mxfp4_experts(moe.gguf, root / "experts-mxfp4.gguf", expanded=False)
    values = _with_mxfp4_experts(moe.gguf, root / "experts-mxfp4-values.gguf", expanded=True)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)

    def run(path: Path, **options) -> list:
        llm = LLM(str(path), num_kv_blocks=64, **options)
        return [o.outputs[0] for o in llm.generate(prompt_token_ids=moe.prompts, sampling_params=params,
                                                   use_tqdm=False)]

    exact, reference = run(blocks, **EXACT), run(values, **EXACT)
    for ours, theirs in zip(exact, reference, strict=True):
        assert ours.token_ids == theirs.token_ids
        for a, b in zip(ours.logprobs, theirs.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-5 and [t for t, _ in a.top] == [t for t, _ in b.top]
    own = LLM(str(blocks), num_kv_blocks=64)
    experts = [m for m in own.llm_engine.model_runner.model.modules() if isinstance(m, SparseMoeBlock)][0].experts
    assert experts[0].gate_up_proj.qtypes == [GGMLQuantizationType.MXFP4]
    assert experts[0].down_proj.qtypes == [GGMLQuantizationType.MXFP4]
    # On VNNI builds the experts' rows (multiples of 16) are interleaved (csrc/gguf_interleaved.h).
    interleaved = cpu_kernels().gguf_kernel_isa() == "avx512-vnni"
    assert experts[0].gate_up_proj.parts[0].kernel_type == GGMLQuantizationType.MXFP4 + 256 * interleaved
    assert own.llm_engine.model_runner.fused_decoder is not None
    worst, worst_kl = decode_logits_both_ways(own.engine, [[5, 9, 30, 31, 200], [7] * 20, [11, 12]], steps=4)
    assert worst_kl < 1e-3, (worst, worst_kl)
