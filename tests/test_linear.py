"""The linear-layer kernels (layers/linear.py) against references computed from their own
dequantized weights, the int4 / int8 rules against GGUF's Q4_1 / Q8_0 (gguf's own quantizer), and
whole tiny models per kernel against transformers within each kernel's stated tolerance. The block
kernels themselves, type by type: test_gguf_kernels.py."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from support import compare_logits_step_by_step, tiny_hf_model
from torch import nn

from roseinfer import InferenceEngine, InvalidRequestError
from roseinfer.layers.cpu_kernels import cpu_kernels
from roseinfer.layers.linear import (
    BlockLinear,
    LinearLayerKernels,
    PanelLinear,
    PrepackedLinear,
    float_linear,
    prepare_linear_layers,
)
from roseinfer.layers.quantization.gguf import quantize_to_blocks

Q8_0, Q4_1 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1

ROWS = [1, 5, 64]


def random_linear(out_features: int = 96, in_features: int = 128, bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias)
    linear.weight.data.normal_(0, 0.05)
    return linear


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out - reference).abs().max() / reference.abs().max()).item()


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


@pytest.mark.parametrize("rows", ROWS)
def test_prepacked_equals_f_linear(rows):
    linear = random_linear()
    x = torch.randn(rows, linear.in_features)
    assert relative_error(PrepackedLinear(linear)(x), F.linear(x, linear.weight, linear.bias)) < 1e-5


def panel_dtypes() -> list[str]:
    kernels = cpu_kernels()
    return [] if kernels is None else kernels.panel_linear_dtypes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 7, 8, 9, 64, 300])
@pytest.mark.parametrize(("out_features", "in_features", "bias"), [(96, 128, True), (70, 62, False), (960, 576, True)])
def test_panel_kernel_against_float64(dtype, rows, out_features, in_features, bias):
    """float32: within float32 summation error of the float64 result. bfloat16: each output is the
    exact sum of bfloat16 products rounded once to bfloat16, so within half a bfloat16 step of the
    float64 result plus float32 summation error. Shapes cover partial row tiles (7, 9, 300 = a pass
    of 256 and 44), a partial last panel (70; 96 = 48 x 2, 960 = 48 x 20) and more passes than one."""
    name = str(dtype).removeprefix("torch.")
    if name not in panel_dtypes():
        pytest.skip(f"this CPU's build has no {name} panel kernel (it is built where AVX-512 exists without AMX)")
    linear = random_linear(out_features, in_features, bias).to(dtype)
    layer = float_linear(linear)
    assert isinstance(layer, PanelLinear)
    x = torch.randn(2, rows, in_features).to(dtype)  # leading dimensions are kept
    out = layer(x)
    assert out.shape == (2, rows, out_features) and out.dtype == dtype
    weight = linear.weight.double()
    exact = x.double() @ weight.T + (linear.bias.double() if bias else 0)
    magnitude = x.double().abs() @ weight.abs().T
    rounding = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-23
    assert ((out.double() - exact).abs() <= exact.abs() * rounding + magnitude * 2.0**-16).all()


def test_float_linear_keeps_onednn_where_the_panel_kernel_does_not_apply():
    odd = random_linear(32, 63).to(torch.bfloat16)  # bfloat16 steps by pairs of inputs
    assert type(float_linear(odd)) is PrepackedLinear
    expected = PanelLinear if "float32" in panel_dtypes() else PrepackedLinear
    assert type(float_linear(random_linear())) is expected


def test_the_load_log_counts_onednn_prepacked_weights():
    """oneDNN's prepacked weights (what every float layer is on AMX CPUs, where the panel kernel
    stands aside) have no storage: the load's weight summary counts them all the same (it raised
    "Cannot access data pointer" on an AMX Xeon, so no float model loaded there)."""
    from roseinfer.models.loader import describe_weights

    model = nn.Sequential(PrepackedLinear(nn.Linear(64, 32)), PrepackedLinear(nn.Linear(32, 16, bias=False)))
    assert model[0].packed_weight.is_mkldnn
    summary = describe_weights(model)
    assert summary.startswith("float32") and "(3)" in summary, summary


def blocks_of(weight: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """The weight as our int8 / int4 quantization leaves it, expanded by gguf's own numpy code."""
    blocks = quantize_to_blocks(weight, qtype)
    return torch.from_numpy(dequantize(blocks.data.numpy(), qtype).reshape(weight.shape))


@pytest.mark.parametrize("qtype", [Q8_0, Q4_1])
def test_int8_int4_blocks_are_gguf_q8_0_q4_1(qtype):
    """The same bytes as gguf's own quantizer (ggml's reference rule) on random weights, and a
    file's own codes back from its dequantized values."""
    weights = torch.randn(16, 256, generator=torch.Generator().manual_seed(2)) * 0.05
    ours = quantize_to_blocks(weights, qtype).data.numpy()
    assert np.array_equal(ours, quantize(weights.numpy(), qtype))
    file_values = torch.from_numpy(dequantize(ours, qtype).reshape(weights.shape))
    assert np.array_equal(quantize_to_blocks(file_values, qtype).data.numpy(), ours)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_quantized_layers_multiply_their_blocks(quantization, rows):
    linear = random_linear()
    model = nn.Sequential(linear)
    assert prepare_linear_layers(model, quantization, torch.device("cpu")) == 1
    layer = model[0]
    assert isinstance(layer, BlockLinear) and layer.qtypes == [Q8_0 if quantization == "int8" else Q4_1]
    x = torch.randn(rows, linear.in_features)
    weight = blocks_of(linear.weight.detach(), layer.qtypes[0])
    # 8-bit activations (small batches) or bfloat16 products (large ones) cost ~1% at most
    assert relative_error(layer(x), x @ weight.T + linear.bias) < 2e-2
    # and each weight is within a step of the float one (steps are ~max|w|/127 and range/15)
    step = weight.abs().max() / (127 if quantization == "int8" else 7)
    assert (weight - linear.weight).abs().max() <= step


def test_unknown_quantization_is_refused():
    with pytest.raises(InvalidRequestError, match="quantization must be one of"):
        prepare_linear_layers(nn.Sequential(random_linear()), "fp8", torch.device("cpu"))
    with pytest.raises(InvalidRequestError, match="quantization"):
        InferenceEngine(quantization="int3")


@torch.no_grad()
def with_dequantized_weights(model: nn.Module, quantization: str) -> nn.Module:
    """A transformers model whose linear weights are replaced by what our kernels multiply by
    (each row is quantized on its own, so fused and separate matrices quantize alike)."""
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or quantization in ("none", "auto"):
            continue
        qtype = Q8_0 if quantization == "int8" or name == "lm_head" else Q4_1  # int4's head is Q8_0
        module.weight.copy_(blocks_of(module.weight, qtype))
    return model


@pytest.mark.parametrize("quantization", ["auto", "none", "int8", "int4"])
def test_tiny_llama_per_kernel_against_transformers(quantization, tmp_path):
    """Whole-model logits (spread about 0.8 here) against transformers with the weights our kernels
    use: with float activations the block kernels differ by summation order only; where they round
    the activations (8 bits for small batches on VNNI CPUs, bfloat16 for prefill where the CPU has
    bfloat16 dot products), by that rounding through 2 layers (test_gguf_kernels.py checks each
    product against exactly that rounding)."""
    reference = tiny_hf_model("llama", tmp_path / "llama")
    engine = InferenceEngine(str(tmp_path / "llama"), num_kv_blocks=32, quantization=quantization, device="cpu")
    rounded_activations = quantization in ("int8", "int4")
    tolerance = 0.1 if rounded_activations else 1e-3
    kinds = {type(m).__name__ for m in engine.model.modules()}
    if rounded_activations:
        expected = "BlockLinear"
    else:  # a float32 checkpoint's weights stay float32 under auto and none alike
        expected = "PanelLinear" if "float32" in panel_dtypes() else "PrepackedLinear"
    assert expected in kinds and "Linear" not in kinds
    reference = with_dequantized_weights(reference, quantization)
    worst = compare_logits_step_by_step(engine, reference, [[5, 9, 30, 31, 200], [7] * 20], 4)
    assert worst < tolerance, f"{quantization}: max |logit difference| {worst}"


def test_quantization_needs_the_cpu():
    with pytest.raises(InvalidRequestError, match="CPU kernels only"):
        LinearLayerKernels("int4", torch.device("meta"))


def test_tiny_llama_in_bfloat16_against_transformers(tmp_path):
    """A bfloat16 model (its linear layers on the panel kernel where the CPU has one, else oneDNN)
    against transformers in float32 with the same bfloat16-rounded weights: they differ by the
    rounding of activations to bfloat16 (2^-8 relative) through 2 layers; measured 0.028 with
    either kernel, against logits spread about 0.8."""
    reference = tiny_hf_model("llama", tmp_path / "llama")
    engine = InferenceEngine(str(tmp_path / "llama"), num_kv_blocks=32, dtype="bfloat16", device="cpu")
    kinds = {type(m).__name__ for m in engine.model.modules()}
    expected = "PanelLinear" if "bfloat16" in panel_dtypes() else "PrepackedLinear"
    assert expected in kinds and "Linear" not in kinds
    worst = compare_logits_step_by_step(engine, reference.to(torch.bfloat16).float(), [[5, 9, 30, 31, 200], [7] * 20], 4)
    assert worst < 0.06, f"max |logit difference| {worst}"


def test_auto_follows_a_bfloat16_checkpoints_dtype_where_the_cpu_has_bfloat16_products(tmp_path):
    """--quantization auto keeps a bfloat16 checkpoint in bfloat16 on CPUs with bfloat16 dot products
    (float32 elsewhere, where bfloat16 products would be emulated); none expands it to float32."""
    from roseinfer.layers.cpu_kernels import cpu_has_bfloat16_dot_products

    model = tiny_hf_model("llama", tmp_path / "llama")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "llama")  # config.json now says bfloat16
    auto = InferenceEngine(str(tmp_path / "llama"), num_kv_blocks=16, device="cpu")
    assert auto.dtype == (torch.bfloat16 if cpu_has_bfloat16_dot_products() else torch.float32)
    exact = InferenceEngine(str(tmp_path / "llama"), num_kv_blocks=16, quantization="none", device="cpu")
    assert exact.dtype == torch.float32
