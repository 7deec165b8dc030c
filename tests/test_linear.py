"""The linear-layer kernels (layers/linear.py) against references computed from their own
dequantized weights, the int4 / int8 rules against GGUF's Q4_1 / Q8_0, and whole tiny models per
kernel against transformers within each kernel's stated tolerance."""

import pytest
import torch
import torch.nn.functional as F
from support import compare_logits_step_by_step, tiny_hf_model
from torch import nn

from roseinfer import InferenceEngine, InvalidRequestError
from roseinfer.layers.cpu_kernels import cpu_kernels
from roseinfer.layers.linear import (
    BlockQuantLinear,
    PanelLinear,
    PrepackedLinear,
    float_linear,
    prepare_linear_layers,
    quantize_int4_groups,
    quantize_int8_groups,
)

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


def blocks_of(linear: nn.Linear, bits: int) -> torch.Tensor:
    """The weight a BlockQuantLinear multiplies by, rebuilt here from its codes and scales with
    plain tensor arithmetic (not the layer's own dequantization)."""
    layer = BlockQuantLinear(linear, bits)
    rows = linear.out_features
    if bits == 8:
        return (layer.codes.float().view(rows, -1, 32) * layer.scales[..., None]).view(rows, -1)
    low, high = (layer.codes & 15).float(), (layer.codes >> 4).float()
    groups = torch.cat([low.view(rows, -1, 16), high.view(rows, -1, 16)], dim=-1)
    return (groups * layer.scales[..., None] + layer.minimums[..., None]).view(rows, -1)


def kernel_reference(layer: BlockQuantLinear, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the small-batch kernel computes, in plain tensor arithmetic. Built with VNNI it
    quantizes x to 8 bits per block of 32 (round(x * 127 / max|x|)) and multiplies integers; for
    4-bit blocks the minimums, and the codes' centre 8, meet the float x, so the error is
    scale * sum((codes - 8) * (quantized x - x)). Otherwise it is x @ weight.T in float32."""
    kernels = layer._kernels
    if (kernels is None or not kernels.quantizes_activations() or not layer.quantize_activations
            or x.shape[0] > layer.SMALL_BATCH):
        return x @ weight.T
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    quantized = (torch.round(blocks * (127.0 / amax)) * (amax / 127.0)).view_as(x)
    if layer.bits == 8:
        return quantized @ weight.T
    # w = scale * (codes - 8) + (8 * scale + minimum): only the first part sees the quantized x
    offset = (8 * layer.scales + layer.minimums).repeat_interleave(32, dim=1)
    return quantized @ (weight - offset).T + x @ offset.T


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 17, 64, 129])  # the kernel's tiles, the matrix product past 128
def test_block_quant_matches_its_dequantized_weight(bits, rows):
    linear = random_linear()
    layer = BlockQuantLinear(linear, bits)
    x = torch.randn(rows, linear.in_features)
    weight = blocks_of(linear, bits)
    assert relative_error(layer(x), kernel_reference(layer, x, weight) + linear.bias) < 1e-5
    # the activations' 8-bit blocks cost under 2% of the float product
    assert relative_error(layer(x), x @ weight.T + linear.bias) < 2e-2
    if bits == 8:  # as the LM head is built: float activations
        head = BlockQuantLinear(linear, bits, quantize_activations=False)
        assert relative_error(head(x), x @ weight.T + linear.bias) < 1e-5
    assert torch.allclose(layer.dequantized_weight(), weight, rtol=0, atol=1e-6)
    # and each weight is within half a step of the float one
    step = layer.scales.repeat_interleave(32, dim=1)
    assert ((weight - linear.weight).abs() <= 0.501 * step + 1e-7).all()
    batched = layer(x.view(1, rows, -1).expand(2, rows, -1))
    as_one_batch = kernel_reference(layer, x.repeat(2, 1), weight)[rows:] + linear.bias
    assert batched.shape == (2, rows, linear.out_features) and relative_error(batched[1], as_one_batch) < 1e-5


@pytest.mark.parametrize("rows", [31, 32, 33, 70, 129, 300])  # past 32 rows: the blocked matrix product
@pytest.mark.parametrize("shape", [(101, 64), (250, 576), (6, 32)])  # weight rows not whole groups of 6 or panels
def test_8bit_blocks_against_float_activations_at_batch_sizes(rows, shape):
    """The LM head's kernel (8-bit blocks, float activations) at any batch size equals the float
    product with its dequantized weight (only the order of the sums differs)."""
    linear = random_linear(*shape, bias=False)
    head = BlockQuantLinear(linear, 8, quantize_activations=False)
    x = torch.randn(rows, linear.in_features)
    assert relative_error(head(x), x @ blocks_of(linear, 8).T) < 1e-5


def test_int8_groups_recover_gguf_q8_0_codes():
    """Q8_0 stores w = d * q per group of 32 (d in float16, the group's largest |q| is 127):
    quantizing such weights gives back the file's codes."""
    torch.manual_seed(2)
    codes = torch.randint(-127, 128, (8, 6, 32))
    codes[..., 0] = 127
    d = (torch.rand(8, 6) * 0.01 + 1e-3).half().float()
    weight = (codes * d[..., None]).view(8, 192)
    recovered, scale = quantize_int8_groups(weight)
    assert torch.equal(recovered.view(8, 6, 32), codes.to(torch.int8))
    assert torch.allclose(scale, d, rtol=1e-6)


def test_int4_groups_recover_gguf_q4_1_codes():
    """Q4_1 stores w = d * q + m per group of 32 (d, m in float16); min/max quantization of such
    weights gives back exactly the file's codes."""
    torch.manual_seed(1)
    rows, groups = 8, 6
    codes = torch.randint(0, 16, (rows, groups, 32))
    codes[..., 0], codes[..., 1] = 0, 15  # Q4_1's own quantizer puts a group's min at 0, max at 15
    d = (torch.rand(rows, groups) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(rows, groups) * 0.1).half().float()
    weight = (codes * d[..., None] + m[..., None]).view(rows, groups * 32)
    recovered, scale, minimum = quantize_int4_groups(weight)
    assert torch.equal(recovered.view(rows, groups, 32), codes.int())
    assert torch.allclose(scale, d, rtol=1e-6) and torch.equal(minimum, m)


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
        if not isinstance(module, nn.Linear) or quantization == "none":
            continue
        bits = 8 if quantization == "int8" or name == "lm_head" else 4  # int4's head is in 8-bit blocks
        module.weight.copy_(blocks_of(module, bits))
    return model


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_tiny_llama_per_kernel_against_transformers(quantization, tmp_path):
    """Whole-model logits (spread about 0.8 here) against transformers with the weights our kernels
    use: with float32 activations the blocked kernels differ by summation order only; where they
    quantize the activations of small batches to 8 bits (VNNI), by that rounding through 2 layers
    (test_block_quant_matches_its_dequantized_weight checks each product exactly)."""
    reference = tiny_hf_model("llama", tmp_path / "llama")
    engine = InferenceEngine(str(tmp_path / "llama"), num_kv_blocks=32, quantization=quantization)
    kernels = cpu_kernels()
    quantized_activations = quantization != "none" and kernels is not None and kernels.quantizes_activations()
    tolerance = 0.1 if quantized_activations else 1e-3
    kinds = {type(m).__name__ for m in engine.model.modules()}
    if quantization != "none":
        expected = "BlockQuantLinear"
    else:
        expected = "PanelLinear" if "float32" in panel_dtypes() else "PrepackedLinear"
    assert expected in kinds and "Linear" not in kinds
    reference = with_dequantized_weights(reference, quantization)
    worst = compare_logits_step_by_step(engine, reference, [[5, 9, 30, 31, 200], [7] * 20], 4)
    assert worst < tolerance, f"{quantization}: max |logit difference| {worst}"


def test_tiny_llama_in_bfloat16_against_transformers(tmp_path):
    """A bfloat16 model (its linear layers on the panel kernel where the CPU has one, else oneDNN)
    against transformers in float32 with the same bfloat16-rounded weights: they differ by the
    rounding of activations to bfloat16 (2^-8 relative) through 2 layers; measured 0.028 with
    either kernel, against logits spread about 0.8."""
    reference = tiny_hf_model("llama", tmp_path / "llama")
    engine = InferenceEngine(str(tmp_path / "llama"), num_kv_blocks=32, dtype="bfloat16")
    kinds = {type(m).__name__ for m in engine.model.modules()}
    expected = "PanelLinear" if "bfloat16" in panel_dtypes() else "PrepackedLinear"
    assert expected in kinds and "Linear" not in kinds
    worst = compare_logits_step_by_step(engine, reference.to(torch.bfloat16).float(), [[5, 9, 30, 31, 200], [7] * 20], 4)
    assert worst < 0.06, f"max |logit difference| {worst}"
