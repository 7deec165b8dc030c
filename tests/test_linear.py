"""The linear-layer kernels (layers/linear.py) against references computed from their own
dequantized weights, the int4 rule against GGUF's Q4_1, and whole tiny models per kernel against
transformers within each kernel's stated tolerance."""

import pytest
import torch
import torch.nn.functional as F
from support import compare_logits_step_by_step, tiny_hf_model
from torch import nn

from roseinfer import InferenceEngine, InvalidRequestError
from roseinfer.layers.linear import (
    DynamicInt8Linear,
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    PrepackedLinear,
    prepare_linear_layers,
    quantize_int4_groups,
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


@pytest.mark.parametrize("rows", ROWS)
def test_int8_weight_only_matches_its_dequantized_weight(rows):
    linear = random_linear()
    layer = Int8WeightOnlyLinear(linear)
    x = torch.randn(rows, linear.in_features)
    weight = layer.qweight.float() * bf16(layer.scales)[:, None]
    reference = bf16(x) @ weight.T + linear.bias
    assert relative_error(layer(x), reference) < 1e-2  # the kernel's output is bfloat16
    # and the int8 weight is within half a step of the float weight
    assert ((weight - linear.weight).abs() <= 0.501 * layer.scales.float()[:, None]).all()


def int4_dequantized(linear: nn.Linear) -> torch.Tensor:
    """The weight an Int4WeightOnlyLinear multiplies by: (code - 8) * scale + zero, per group."""
    layer = Int4WeightOnlyLinear(linear)
    codes, _, _ = quantize_int4_groups(linear.weight)
    scale, zero = bf16(layer.scales_and_zeros).unbind(-1)  # [K / 32, N] each
    groups = (codes.float() - 8).view(linear.out_features, -1, 32)
    return (groups * scale.T[..., None] + zero.T[..., None]).view_as(linear.weight)


@pytest.mark.parametrize("rows", ROWS)
def test_int4_weight_only_matches_its_dequantized_weight(rows):
    linear = random_linear()
    x = torch.randn(rows, linear.in_features)
    reference = bf16(x) @ int4_dequantized(linear).T + linear.bias
    assert relative_error(Int4WeightOnlyLinear(linear)(x), reference) < 1e-2


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


@pytest.mark.parametrize("rows", ROWS)
def test_dynamic_int8_is_within_activation_rounding_of_float(rows):
    linear = random_linear()
    layer = DynamicInt8Linear(linear)
    x = torch.randn(rows, linear.in_features)
    # Weights and activations both rounded to 8 bits: about 1% of the output's range.
    assert relative_error(layer(x), F.linear(x, linear.weight, linear.bias)) < 3e-2


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
        if not isinstance(module, nn.Linear):
            continue
        if quantization == "int8":
            module.weight.copy_(Int8WeightOnlyLinear(module).dequantized_weight())
        elif quantization == "int4" and name != "lm_head":  # the head stays in float
            module.weight.copy_(int4_dequantized(module))
    return model


@pytest.mark.parametrize(
    ("quantization", "tolerance"),
    [("none", 1e-3), ("int8", 0.05), ("int4", 0.05), ("dynamic-int8", 0.2)],
)
def test_tiny_llama_per_kernel_against_transformers(quantization, tolerance, tmp_path):
    """Whole-model logits (spread about 0.8 here) against transformers with the weights our kernels
    use: the weight-only kernels differ by their bfloat16 activations only; dynamic int8 also
    rounds activations to 8 bits, so it is held to the float model within that rounding."""
    reference = tiny_hf_model("llama", tmp_path / "llama")
    engine = InferenceEngine(str(tmp_path / "llama"), num_kv_blocks=32, quantization=quantization)
    kinds = {type(m).__name__ for m in engine.model.modules()}
    expected = {"none": "PrepackedLinear", "int8": "Int8WeightOnlyLinear",
                "int4": "Int4WeightOnlyLinear", "dynamic-int8": "DynamicInt8Linear"}[quantization]
    assert expected in kinds and "Linear" not in kinds
    reference = with_dequantized_weights(reference, quantization)
    worst = compare_logits_step_by_step(engine, reference, [[5, 9, 30, 31, 200], [7] * 20], 4)
    assert worst < tolerance, f"{quantization}: max |logit difference| {worst}"
