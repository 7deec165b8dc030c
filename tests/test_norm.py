"""RMSNorm: the C++ CPU kernels (plain and fused with the residual add) against PyTorch's rms_norm
computed in float64, and the layer's PyTorch fallback for tensors the kernels do not take."""

import pytest
import torch
import torch.nn.functional as F

from roseinfer.layers.norm import RMSNorm

# float32: a few ulps of values around 1-4; bfloat16: one rounding of the result (8 bits of mantissa).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 4e-2}


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.double(), (x.shape[-1],), weight.double(), eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (300, 576), (5, 3, 100)])
def test_kernels_match_pytorch(kernels, dtype, shape):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=generator).to(dtype)
    residual = torch.randn(shape, generator=generator).to(dtype)
    weight = torch.randn(shape[-1], generator=generator).to(dtype)

    out = kernels.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out.double(), reference(x, weight, 1e-5), atol=TOLERANCE[dtype], rtol=0)

    expected_residual = residual + x  # rounded to dtype, as the unfused add is
    x_copy, residual_copy = x.clone(), residual.clone()
    kernels.fused_add_rms_norm(x_copy, residual_copy, weight, 1e-5)
    assert torch.equal(residual_copy, expected_residual)
    torch.testing.assert_close(
        x_copy.double(), reference(expected_residual, weight, 1e-5), atol=TOLERANCE[dtype], rtol=0
    )


def test_kernels_reject_what_they_cannot_read(kernels):
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight"):
        kernels.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.rms_norm(x.t(), torch.ones(4), 1e-5)


def test_layer_on_non_contiguous_input_uses_pytorch_and_agrees():
    norm = RMSNorm(16, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 16))
    x = torch.randn(6, 3, 32)[..., :16]  # a view, as Qwen3's per-head q/k norms see
    residual = torch.randn(6, 3, 32)[..., 16:]
    assert not x.is_contiguous()
    torch.testing.assert_close(norm(x).double(), reference(x, norm.weight.detach(), 1e-6), atol=1e-5, rtol=0)
    normed, summed = norm.add_and_norm(x, residual)
    torch.testing.assert_close(summed, x + residual)
    torch.testing.assert_close(normed.double(), reference(x + residual, norm.weight.detach(), 1e-6), atol=1e-5, rtol=0)
    # The contiguous path (the kernel where it builds) gives the same numbers.
    torch.testing.assert_close(norm(x.contiguous()), norm(x), atol=1e-5, rtol=0)
