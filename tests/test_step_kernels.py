"""The C++ kernels around a decode step's matmuls, against the PyTorch ops they replace: storing
new keys and values in the pool (index_copy_), SiLU(gate) * up, and greedy sampling's argmax.
Each must give exactly what PyTorch gives (the SiLU on AVX-512 builds, which use the same exp as
PyTorch's own kernel), in parallel and serial sizes alike."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from roseinfer.layers import cpu_kernels as cpu_kernels_module
from roseinfer.layers.activation import silu_and_mul
from roseinfer.layers.attention import kv_rows, kv_values
from roseinfer.layers.attention_backends import CpuKernelAttentionBackend, TorchAttentionBackend
from roseinfer.worker.sampler import greedy_tokens


def has_avx512() -> bool:
    try:
        return " avx512f " in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.mark.parametrize(("model_dtype", "pool_dtype"), [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.float64, torch.float64),
])
@pytest.mark.parametrize("tokens", [1, 64, 700])
def test_write_kv_matches_index_copy(kernels, model_dtype, pool_dtype, tokens):
    generator = torch.Generator().manual_seed(tokens)
    kv_heads, head_dim, blocks, block_size = 3, 64, 80, 16
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * head_dim, generator=generator).to(model_dtype)
    # k and v as the model hands them over: strided views of the fused projection's output.
    k = qkv[:, 9 * head_dim : (9 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (9 + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(blocks * block_size, generator=generator)[:tokens]
    pool = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=generator).to(pool_dtype)
    expected = pool.clone()
    flat = expected.view(2, -1, kv_heads, head_dim)
    flat[0].index_copy_(0, slots, k.to(pool_dtype))
    flat[1].index_copy_(0, slots, v.to(pool_dtype))
    CpuKernelAttentionBackend.create(torch.device("cpu"), block_size).write_kv(pool, slots, k, v)
    assert torch.equal(pool, expected)


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_quantizes_q8_0_rows_as_llama_cpp(kernels, model_dtype):
    """--kv-cache-dtype q8_0: each head's row is stored as 64 int8 codes then a float16 scale per
    32 values (scale = max|x| / 127, codes = round(x / scale)): the kernel's bytes equal the
    PyTorch path's, and every value comes back within half a step (plus the float16 scale's
    rounding, as in llama.cpp)."""
    generator = torch.Generator().manual_seed(5)
    x = (torch.randn(50, 3, 64, generator=generator) * torch.tensor([0.01, 1.0, 30.0]).view(1, 3, 1)).to(model_dtype)
    x[0, 0, :32] = 0  # an all-zero block: scale 0, codes 0
    slots = torch.randperm(64, generator=generator)[:50]
    pool = torch.zeros(2, 4, 16, 3, 64 + 4, dtype=torch.int8)
    kernels.write_kv_(pool, slots, x, -x)
    rows = pool.view(2, -1, 3, 68)
    expected = kv_rows(x, torch.int8)
    assert torch.equal(rows[0][slots], expected) and torch.equal(rows[1][slots], kv_rows(-x, torch.int8))
    back = kv_values(rows[0][slots], 64, torch.float32)
    step = rows[0][slots][..., 64:].contiguous().view(torch.float16).float().repeat_interleave(32, -1)
    assert ((back - x.float()).abs() <= (0.5 + 127 * 2**-11) * step + 1e-12).all()
    fallback = torch.zeros_like(pool)  # heads not contiguous: the PyTorch path
    spread = torch.zeros(50, 3, 64, 2, dtype=model_dtype)
    spread[..., 0] = x
    CpuKernelAttentionBackend.create(torch.device("cpu"), 16).write_kv(fallback, slots, spread[..., 0], -spread[..., 0])
    assert torch.equal(fallback, pool)
    plain = torch.zeros_like(pool)  # the PyTorch backend stores the same bytes
    TorchAttentionBackend.create(torch.device("cpu"), 16).write_kv(plain, slots, x, -x)
    assert torch.equal(plain, pool)


def test_write_kv_rejects_a_slot_outside_the_pool(kernels):
    pool = torch.zeros(2, 4, 16, 1, 8)
    k = torch.ones(1, 1, 8)
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernels.write_kv_(pool, torch.tensor([64]), k, k)
    assert not pool.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (64, 1536), (5, 37)])
def test_silu_and_mul_matches_pytorch(kernels, dtype, rows, width):
    generator = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(rows, 2 * width, generator=generator) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    out = silu_and_mul(gate_up)
    assert out.dtype == dtype and out.shape == (rows, width)
    if has_avx512():
        assert torch.equal(out, expected)
    else:  # the compiler's exp: within a rounding of the storage type
        torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_matches_torch_max(kernels, dtype):
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(67, 49152, generator=generator).to(dtype)
    logits[1, 100] = logits[1, 40_000] = 50.0  # a tie: the first index wins
    logits[2, :] = float("-inf")
    logits[2, 7] = -1e4  # masked rows, as a grammar's bitmask leaves them
    logits[3, -1] = 60.0  # the last index
    logits[4, :] = 1.0  # all equal
    out = greedy_tokens(logits)
    assert out.dtype == torch.long
    assert torch.equal(out, logits.max(dim=-1).indices)
    assert out[1] == 100 and out[2] == 7 and out[3] == 49151 and out[4] == 0
    assert torch.equal(greedy_tokens(logits[:5, :1000]), logits[:5, :1000].max(dim=-1).indices)  # strided rows


def test_builds_wait_for_each_other_and_a_killed_builds_lock_is_removed(tmp_path):
    # PyTorch's builder waits forever on its lock file; one left by a killed build must not hang
    # every later start. A build waits for another's (the machine-wide lock); a module already
    # built does not wait.
    import fcntl
    import threading

    building, built = tmp_path / "building", tmp_path / "built"
    for build in (building, built):
        build.mkdir()
    (building / "lock").touch()  # a killed build's leftover
    (built / "built.so").touch()
    entered = threading.Event()

    def build() -> None:
        with cpu_kernels_module._one_build_at_a_time(building):
            entered.set()

    with open(tmp_path / "roseinfer-kernel-build.lock", "w") as other_build:
        fcntl.flock(other_build, fcntl.LOCK_EX)  # another process's build in progress
        with cpu_kernels_module._one_build_at_a_time(built):
            pass  # already built: no wait (this would block for ever otherwise)
        waiting = threading.Thread(target=build)
        waiting.start()
        assert not entered.wait(1.0)
        assert (building / "lock").exists()
    waiting.join(timeout=30)
    assert entered.is_set()
    assert not (building / "lock").exists()
