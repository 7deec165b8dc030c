"""gpt-oss (models/gpt_oss.py): a tiny random model built by transformers' own GptOssForCausalLM
(attention sinks, sliding windows alternating with full attention, biased router and experts, the
clamped SwiGLU, YaRN), saved as a Hugging Face directory and converted to GGUF by llama.cpp's own
converter. roseinfer's greedy tokens equal transformers' float32 ones, and with teacher forcing its
logits stay within float32 tolerance, on prompts longer than the window, from both files and under
both attention backends."""

from pathlib import Path

import numpy as np
import pytest
import torch
from hf_to_gguf import convert_hf_to_gguf, write_default_tokenizer
from support import EXACT, compare_logits_step_by_step

from roseinfer import LLM, SamplingParams
from roseinfer.layers.attention import PagedAttention
from roseinfer.models.gpt_oss import GptOssForCausalLM, GptOssMoeBlock

TOKENS = 24
TOLERANCE = 1e-3  # float32 logits
WINDOW = 8
# A single token, one inside the window, and two well past it (one past two KV blocks of 16).
PROMPT_LENGTHS = (1, 5, 19, 40)


def tiny_gpt_oss_config(vocab: int):
    import transformers

    return transformers.GptOssConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=0,
        bos_token_id=0, initializer_range=0.1,
        # YaRN with a ramp inside the head's frequencies (the real model's: factor 32 over 4096).
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
    )


class TinyGptOss:
    def __init__(self, root: Path) -> None:
        import transformers

        self.hf_dir = root / "gpt_oss"
        vocab = write_default_tokenizer(self.hf_dir)
        config = tiny_gpt_oss_config(vocab)
        torch.manual_seed(0)
        self.reference = transformers.GptOssForCausalLM(config).eval()
        with torch.no_grad():  # biases and sinks are zero-initialised: make them matter
            for name, param in self.reference.named_parameters():
                if name.endswith(("bias", "sinks")):
                    param.normal_(0.0, 0.5)
        self.reference.save_pretrained(self.hf_dir)
        self.gguf = convert_hf_to_gguf(self.hf_dir, root / "gpt_oss-f32.gguf", "f32")
        generator = torch.Generator().manual_seed(1)
        self.prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
        self.expected = [reference_greedy(self.reference, prompt) for prompt in self.prompts]


@torch.no_grad()
def reference_greedy(reference, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation, end-of-text included like any other token."""
    ids = torch.tensor([prompt])
    for _ in range(TOKENS):
        ids = torch.cat([ids, reference(ids).logits[:, -1].argmax(-1, keepdim=True).cpu()], dim=1)
    return ids[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyGptOss:
    return TinyGptOss(tmp_path_factory.mktemp("gpt_oss"))


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


@pytest.mark.parametrize(("source", "backend"), [("hf", "auto"), ("gguf", "auto"), ("hf", "torch")])
def test_greedy_tokens_and_logits_match_transformers(tiny, source, backend):
    path = tiny.hf_dir if source == "hf" else tiny.gguf
    llm = LLM(str(path), num_kv_blocks=64, attention_backend=backend, **EXACT)
    model = llm.engine.runner.model
    assert isinstance(model, GptOssForCausalLM)
    assert model.config.layer_windows == [WINDOW, None, WINDOW, None]
    assert all(m.params.sinks is not None for m in model.modules() if isinstance(m, PagedAttention))
    assert any(isinstance(m, GptOssMoeBlock) for m in model.modules())
    assert _greedy(llm, tiny.prompts) == tiny.expected
    worst = compare_logits_step_by_step(llm.engine, tiny.reference, tiny.prompts, 3)
    assert worst < TOLERANCE, f"max |logit difference| {worst}"


def test_sinks_change_the_answer(tiny):
    """The sinks are read: zeroed, the logits move (a test that the parameter is not ignored)."""
    llm = LLM(str(tiny.hf_dir), num_kv_blocks=64, **EXACT)
    for module in llm.engine.runner.model.modules():
        if isinstance(module, PagedAttention):
            module.sinks.data.fill_(-1e4)  # a sink this low takes no weight: plain softmax
            module.bind_sinks()
    worst = compare_logits_step_by_step(llm.engine, tiny.reference, tiny.prompts[2:3], 1)
    assert worst > 1e-2


def test_chunked_prefill_preemption_and_window_release(tiny):
    """A 16-token budget splits the long prompts into chunks mixed with decodes, and a pool too small
    for all four at full length preempts: the tokens stay transformers'; every block comes back."""
    llm = LLM(str(tiny.gguf), num_kv_blocks=14, max_num_batched_tokens=16, max_num_seqs=4, **EXACT)
    assert _greedy(llm, tiny.prompts) == tiny.expected
    engine = llm.engine
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def requantize_experts(source: Path, target: Path) -> dict[str, np.ndarray]:
    """`source` (a float32 GGUF from the converter) rewritten with every expert matrix in MXFP4
    (gguf's own quantize), as gpt-oss files keep them; returns the expanded values of each
    (gguf's own dequantize), the weights the file now holds."""
    import gguf

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, arch=str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    expanded = {}
    for tensor in reader.tensors:
        values = np.array(tensor.data)
        if tensor.name.endswith("_exps.weight"):
            blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType.MXFP4)
            expanded[tensor.name] = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.MXFP4)
            writer.add_tensor(tensor.name, blocks, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expanded


def test_mxfp4_experts_match_transformers_on_the_same_values(tiny, tmp_path):
    """A file whose experts are MXFP4 blocks, expanded exactly (--quantization none): the tokens
    equal transformers' on a model holding exactly those values. (Under auto the blocks run in the
    MXFP4 kernels with 8-bit activations, as llama.cpp's do: those are checked exact against gguf's
    dequantize in test_gguf_kernels.py, and against the op-by-op forward in test_moe.py.)"""
    quantization = "none"
    import copy

    path = tmp_path / "gpt_oss-mxfp4.gguf"
    expanded = requantize_experts(tiny.gguf, path)
    reference = copy.deepcopy(tiny.reference)
    with torch.no_grad():
        for index, layer in enumerate(reference.model.layers):
            experts = layer.mlp.experts
            gate = torch.from_numpy(expanded[f"blk.{index}.ffn_gate_exps.weight"])  # [E, I, H]
            up = torch.from_numpy(expanded[f"blk.{index}.ffn_up_exps.weight"])
            down = torch.from_numpy(expanded[f"blk.{index}.ffn_down_exps.weight"])  # [E, H, I]
            gate_up = torch.stack([gate, up], dim=2).flatten(1, 2)  # interleaved rows: gate, up, gate, ...
            experts.gate_up_proj.copy_(gate_up.transpose(1, 2))
            experts.down_proj.copy_(down.transpose(1, 2))
    assert not torch.equal(reference.model.layers[0].mlp.experts.down_proj,
                           tiny.reference.model.layers[0].mlp.experts.down_proj)
    expected = reference_greedy(reference, tiny.prompts[3])
    llm = LLM(str(path), num_kv_blocks=64, quantization=quantization)
    assert _greedy(llm, tiny.prompts[3:]) == [expected]


def write_mxfp4_checkpoint(tiny: TinyGptOss, directory: Path) -> dict[str, torch.Tensor]:
    """The tiny model as the released gpt-oss checkpoints are stored: every expert matrix as MXFP4
    `*_blocks` / `*_scales` (quantized by gguf's own MXFP4 quantizer, its bytes laid out as the
    checkpoints do: two values a byte, in order) and `quantization_config` mxfp4. Returns the
    dense values transformers' own MXFP4 expansion gives them ([experts, in, out], as its params)."""
    import json
    import shutil

    import gguf
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    shutil.copytree(tiny.hf_dir, directory)
    state = {name: tensor.contiguous() for name, tensor in tiny.reference.state_dict().items()}
    expanded = {}
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weight = state.pop(name).transpose(1, 2).contiguous()  # [experts, out, in]
        packed = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.MXFP4)  # [E, out, G * 17]
        packed = torch.from_numpy(packed).reshape(*weight.shape[:2], -1, 17)
        scales, codes = packed[..., 0], packed[..., 1:]
        # GGUF's block: value j in byte j's low nibble, value j + 16 in its high one.
        values = torch.cat([codes & 0x0F, codes >> 4], dim=-1)
        blocks = (values[..., 0::2] | (values[..., 1::2] << 4)).to(torch.uint8)
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks.contiguous(), scales.contiguous()
        expanded[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(state, directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (directory / "config.json").write_text(json.dumps(config))
    return expanded


def test_released_mxfp4_layout_from_hf_and_through_the_converter(tiny, tmp_path):
    """A checkpoint stored as the released ones (MXFP4 experts): from its directory, and from the
    GGUF llama.cpp's converter makes of it (its experts repacked to GGUF MXFP4 blocks), the tokens
    equal transformers' on the values its own MXFP4 expansion gives."""
    import copy

    import gguf

    expanded = write_mxfp4_checkpoint(tiny, tmp_path / "mxfp4")
    reference = copy.deepcopy(tiny.reference)
    with torch.no_grad():
        for name, values in expanded.items():
            reference.get_parameter(name).copy_(values)
    expected = reference_greedy(reference, tiny.prompts[3])
    assert not torch.equal(reference.model.layers[0].mlp.experts.down_proj,
                           tiny.reference.model.layers[0].mlp.experts.down_proj)  # rounded to MXFP4
    path = convert_hf_to_gguf(tmp_path / "mxfp4", tmp_path / "mxfp4.gguf", "f32")
    reader = gguf.GGUFReader(path)
    assert {t.tensor_type for t in reader.tensors if t.name.endswith("_exps.weight")} == {
        gguf.GGMLQuantizationType.MXFP4}
    for source in (tmp_path / "mxfp4", path):
        llm = LLM(str(source), num_kv_blocks=64, **EXACT)
        assert _greedy(llm, tiny.prompts[3:]) == [expected], source
