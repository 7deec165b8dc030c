"""Paged decode attention: the compiled CPU kernel against the plain PyTorch path (gathered blocks
+ SDPA) on random pools, for several head layouts, dtypes and context lengths that end anywhere
in a block; and a whole model run with each backend against transformers."""

import pytest
import torch
from support import compare_logits_step_by_step, tiny_hf_model

from roseinfer import InferenceEngine
from roseinfer.errors import InvalidRequestError
from roseinfer.layers.attention import AttentionMetadata, PagedAttention, kv_rows, kv_values

BLOCK_SIZE = 16
Q8_BOUND = 0.1  # q8_0 keys and values: ~0.047 on the tiny Qwen3 (bfloat16 KV: ~0.013 on the tiny Llama)


@pytest.fixture(scope="module")
def kernel(kernels):
    return kernels.paged_decode_attention


def random_step(heads: int, kv_heads: int, head_dim: int, lengths: list[int], dtype: torch.dtype,
                block_size: int = BLOCK_SIZE):
    generator = torch.Generator().manual_seed(0)
    num_blocks = 64
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    max_blocks = -(-max(lengths) // block_size)
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(lengths), max_blocks, dtype=torch.long)
    used = 0
    for row, length in enumerate(lengths):
        count = -(-length // block_size)
        tables[row, :count] = order[used : used + count]
        used += count
    q = torch.randn(len(lengths), heads, head_dim, generator=generator).to(dtype)
    return q, kv_cache, tables, torch.tensor(lengths)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 1, 48), (16, 2, 64)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 5, 32])  # 5: each block ends in an unpaired token (bfloat16)
def test_kernel_matches_the_pytorch_path(kernel, heads, kv_heads, head_dim, dtype, block_size):
    lengths = [1, 15, 16, 17, 100, 33]
    q, kv_cache, tables, lens = random_step(heads, kv_heads, head_dim, lengths, dtype, block_size)
    attention = PagedAttention(heads, kv_heads, head_dim, head_dim**-0.5)
    positions = torch.arange(tables.shape[1] * block_size)
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


@pytest.mark.parametrize(("window", "softcap"), [(7, None), (20, 3.0), (None, 0.5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 5])
def test_kernel_window_and_softcap_match_the_pytorch_path(kernel, window, softcap, dtype, block_size):
    """A sliding window (windows that start anywhere in a block, past whole blocks, or cover the
    whole context) and a soft-cap, as parameters of the layer: the C++ kernel against the PyTorch
    path (the window in its mask, the soft-cap in plain math)."""
    lengths = [1, 7, 8, 15, 17, 100, 33]
    q, kv_cache, tables, lens = random_step(8, 2, 64, lengths, dtype, block_size)
    attention = PagedAttention(8, 2, 64, 64**-0.5, sliding_window=window, softcap=softcap)
    positions = torch.arange(tables.shape[1] * block_size)
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
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.float() - expected).abs().max() < tolerance
    plain = PagedAttention(8, 2, 64, 64**-0.5)._decode(q, kv_cache, kernel_meta).float()
    assert (plain - expected).abs().max() > 10 * tolerance  # the parameters changed the result


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


@pytest.mark.parametrize(("query_dtype", "cache_dtype"), [
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.float32, torch.int8),
    (torch.bfloat16, torch.int8),
])
def test_queries_over_a_narrower_pool(kernel, query_dtype, cache_dtype):
    """--kv-cache-dtype: the kernel reads a 16-bit or q8_0 (int8 codes and scales) pool and agrees
    with the PyTorch path (which converts the gathered blocks), and with attention in the queries'
    dtype over the same rounded keys and values."""
    lengths = [1, 15, 17, 100]
    q, kv_cache, tables, lens = random_step(9, 3, 64, lengths, query_dtype)
    pool = kv_rows(kv_cache, cache_dtype)
    attention = PagedAttention(9, 3, 64, 64**-0.5)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decode_tokens=len(lengths),
                             decode_block_tables=tables, decode_context_lens=lens, decode_kernel=kernel)
    positions = torch.arange(tables.shape[1] * BLOCK_SIZE)
    torch_meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decode_tokens=len(lengths),
                                   decode_block_tables=tables, decode_context_lens=lens,
                                   decode_mask=(positions[None, :] < lens[:, None])[:, None, None, :])
    out = attention._decode(q, pool, meta)
    assert out.dtype == query_dtype
    tolerance = 1e-5 if query_dtype == torch.float32 else 1e-2  # a bfloat16 output's rounding
    assert (out - attention._decode(q, pool, torch_meta)).abs().max() < tolerance
    assert (out - attention._decode(q, kv_values(pool, 64, query_dtype), meta)).abs().max() < tolerance


@pytest.mark.parametrize(("kind", "kv_cache_dtype", "pool_dtype", "bound"), [
    ("llama", "bfloat16", torch.bfloat16, 2e-2), ("qwen3", "q8_0", torch.int8, Q8_BOUND),  # q8_0: heads of 32
])
def test_narrow_kv_cache_model_matches_transformers(tmp_path, request, kind, kv_cache_dtype, pool_dtype, bound):
    """A float32 model over a bfloat16 or q8_0 KV cache (both attention backends): the pool is of
    that dtype and the logits stay close to transformers' float32 ones (keys and values rounded to
    8 bits of mantissa move them by ~1e-2 on this model)."""
    reference = tiny_hf_model(kind, tmp_path / kind)
    for backend in ("cpp", "torch"):
        if backend == "cpp":
            request.getfixturevalue("kernel")
        engine = InferenceEngine(str(tmp_path / kind), num_kv_blocks=32, attention_backend=backend,
                                 kv_cache_dtype=kv_cache_dtype)
        assert engine.runner.kv_caches[0].dtype == pool_dtype
        worst = compare_logits_step_by_step(engine, reference, [[5, 9, 30, 31, 200], [7] * 20, [3]], 20)
        assert 0 < worst < bound, (backend, worst)


def test_q8_0_kv_cache_needs_heads_of_32(tmp_path):
    tiny_hf_model("llama", tmp_path / "llama")  # heads of 16
    with pytest.raises(InvalidRequestError, match="q8_0 needs a head size that is a multiple of 32; this model's is 16"):
        InferenceEngine(str(tmp_path / "llama"), num_kv_blocks=32, kv_cache_dtype="q8_0")


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16"])
def test_a_bfloat16_model_refuses_a_kv_cache_of_another_float_dtype(tmp_path, kv_cache_dtype):
    """The CPU kernels convert keys and values to another pool dtype only from float32: refused at
    start, naming the flag, rather than failing every request at its first step."""
    tiny_hf_model("llama", tmp_path / "llama")
    with pytest.raises(InvalidRequestError, match=f"kv_cache_dtype {kv_cache_dtype} with dtype bfloat16: on the CPU"):
        InferenceEngine(str(tmp_path / "llama"), num_kv_blocks=32, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype)
    engine = InferenceEngine(str(tmp_path / "llama"), num_kv_blocks=32, dtype="bfloat16", kv_cache_dtype="bfloat16")
    assert engine.runner.kv_caches[0].dtype == torch.bfloat16


def test_kv_cache_dtype_is_checked():
    from roseinfer.config import EngineConfig
    from roseinfer.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="kv_cache_dtype .*'fp8'.*llama.cpp's q8_0"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype .*'int8'"):
        EngineConfig(kv_cache_dtype="int8")
    assert EngineConfig(kv_cache_dtype="q8_0").kv_cache_torch_dtype == torch.int8
