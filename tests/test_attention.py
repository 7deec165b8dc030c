"""Paged decode attention: the compiled CPU kernel against the plain PyTorch path (gathered blocks
+ SDPA) on random pools, for several head layouts, dtypes and context lengths that end anywhere
in a block; and a whole model run with each backend against transformers."""

import pytest
import torch
from support import compare_logits_step_by_step, tiny_hf_model

from roseinfer import InferenceEngine
from roseinfer.layers.attention import AttentionMetadata, PagedAttention

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def kernel(kernels):
    return kernels.paged_decode_attention


def random_step(heads: int, kv_heads: int, head_dim: int, lengths: list[int], dtype: torch.dtype):
    generator = torch.Generator().manual_seed(0)
    num_blocks = 64
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=generator).to(dtype)
    max_blocks = -(-max(lengths) // BLOCK_SIZE)
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(lengths), max_blocks, dtype=torch.long)
    used = 0
    for row, length in enumerate(lengths):
        count = -(-length // BLOCK_SIZE)
        tables[row, :count] = order[used : used + count]
        used += count
    q = torch.randn(len(lengths), heads, head_dim, generator=generator).to(dtype)
    return q, kv_cache, tables, torch.tensor(lengths)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 1, 48), (16, 2, 64)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_pytorch_path(kernel, heads, kv_heads, head_dim, dtype):
    lengths = [1, 15, 16, 17, 100, 33]
    q, kv_cache, tables, lens = random_step(heads, kv_heads, head_dim, lengths, dtype)
    attention = PagedAttention(heads, kv_heads, head_dim, head_dim**-0.5)
    positions = torch.arange(tables.shape[1] * BLOCK_SIZE)
    torch_meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long), num_decode_tokens=len(lengths),
        decode_block_tables=tables, decode_context_lens=lens,
        decode_mask=(positions[None, :] < lens[:, None])[:, None, None, :],
    )
    kernel_meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long), num_decode_tokens=len(lengths),
        decode_block_tables=tables, decode_context_lens=lens, decode_kernel=kernel,
    )
    expected = attention._decode(q, kv_cache, torch_meta).float()
    out = attention._decode(q, kv_cache, kernel_meta)
    assert out.dtype == dtype and out.shape == q.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.float() - expected).abs().max() < tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_queries_in_place(kernel, dtype):
    """q as the model hands it over, a strided view of the fused qkv output: read in place, the
    same result as from a contiguous copy."""
    lengths = [1, 17, 100, 33]
    q, kv_cache, tables, lens = random_step(9, 3, 64, lengths, dtype)
    qkv = torch.cat([q.flatten(1), torch.randn(len(lengths), 2 * 3 * 64).to(dtype)], dim=1)
    strided = qkv[:, : 9 * 64].view(len(lengths), 9, 64)
    assert not strided.is_contiguous()
    out = kernel(strided, kv_cache[0], kv_cache[1], tables, lens, 0.125)
    assert out.is_contiguous() and torch.equal(out, kernel(q, kv_cache[0], kv_cache[1], tables, lens, 0.125))


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_each_backend_matches_transformers(backend, tmp_path, request):
    if backend == "cpp":
        request.getfixturevalue("kernel")  # skips where the kernel cannot be built
    reference = tiny_hf_model("qwen2", tmp_path / "qwen2")
    engine = InferenceEngine(str(tmp_path / "qwen2"), num_kv_blocks=32, attention_backend=backend)
    assert (engine.runner.decode_kernel is not None) == (backend == "cpp")
    worst = compare_logits_step_by_step(engine, reference, [[5, 9, 30, 31, 200], [7] * 20, [3]], 20)
    assert worst < 1e-3


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_float32_queries_over_a_16_bit_pool(kernel, cache_dtype):
    """--kv-cache-dtype: the kernel reads a 16-bit pool for float32 queries and agrees with the
    PyTorch path (which converts the gathered blocks), and with float32 attention over the same
    rounded keys and values."""
    lengths = [1, 15, 17, 100]
    q, kv_cache, tables, lens = random_step(9, 3, 64, lengths, torch.float32)
    pool = kv_cache.to(cache_dtype)
    attention = PagedAttention(9, 3, 64, 64**-0.5)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decode_tokens=len(lengths),
                             decode_block_tables=tables, decode_context_lens=lens, decode_kernel=kernel)
    positions = torch.arange(tables.shape[1] * BLOCK_SIZE)
    torch_meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decode_tokens=len(lengths),
                                   decode_block_tables=tables, decode_context_lens=lens,
                                   decode_mask=(positions[None, :] < lens[:, None])[:, None, None, :])
    out = attention._decode(q, pool, meta)
    assert out.dtype == torch.float32
    assert (out - attention._decode(q, pool, torch_meta)).abs().max() < 1e-5
    assert (out - attention._decode(q, pool.float(), meta)).abs().max() < 1e-5


def test_16_bit_kv_cache_model_matches_transformers(tmp_path, request):
    """A float32 model over a bfloat16 KV cache (both attention backends): the pool is bfloat16
    and the logits stay close to transformers' float32 ones (keys and values rounded to 8 bits of
    mantissa move them by ~1e-3 on this model)."""
    reference = tiny_hf_model("llama", tmp_path / "llama")
    for backend in ("cpp", "torch"):
        if backend == "cpp":
            request.getfixturevalue("kernel")
        engine = InferenceEngine(str(tmp_path / "llama"), num_kv_blocks=32, attention_backend=backend,
                                 kv_cache_dtype="bfloat16")
        assert engine.runner.kv_caches[0].dtype == torch.bfloat16
        worst = compare_logits_step_by_step(engine, reference, [[5, 9, 30, 31, 200], [7] * 20, [3]], 20)
        assert 0 < worst < 2e-2, (backend, worst)


def test_kv_cache_dtype_is_checked():
    from roseinfer.config import EngineConfig
    from roseinfer.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="kv_cache_dtype .*'fp8'"):
        EngineConfig(kv_cache_dtype="fp8")
