"""Paged decode attention: the compiled CPU kernel's backend against the plain PyTorch backend
(gathered blocks + SDPA) on random pools, each over the metadata its own `build_metadata` makes,
for several head layouts, dtypes and context lengths that end anywhere in a block; the engine's
one backend as chosen from --attention-backend; and a whole model run with each backend against
transformers."""

import pytest
import torch
from support import compare_logits_step_by_step, tiny_hf_model

from roseinfer import InferenceEngine
from roseinfer.errors import InvalidRequestError
from roseinfer.layers.attention import AttentionLayerParams, kv_rows, kv_values
from roseinfer.layers.attention_backends import (
    ATTENTION_BACKENDS,
    AttentionBatch,
    CpuKernelAttentionBackend,
    PrefillRows,
    TorchAttentionBackend,
    select_attention_backend,
)

BLOCK_SIZE = 16
Q8_BOUND = 0.1  # q8_0 keys and values: ~0.047 on the tiny Qwen3 (bfloat16 KV: ~0.013 on the tiny Llama)


@pytest.fixture(scope="module")
def kernel(kernels):
    return kernels.paged_decode_attention


CPU = torch.device("cpu")


def decode_both_ways(q, kv_cache, tables, lens, layer, block_size=BLOCK_SIZE):
    """The decode rows' attention by the C++ backend and by the PyTorch one (float), each over the
    metadata it builds itself for the same batch."""
    batch = AttentionBatch(slot_mapping=torch.empty(0, dtype=torch.long).numpy(),
                           decode_block_tables=tables.numpy(), decode_context_lens=lens.numpy())
    cpp = CpuKernelAttentionBackend.create(CPU, block_size)
    plain = TorchAttentionBackend.create(CPU, block_size)
    out = cpp.decode(q, kv_cache, cpp.build_metadata(batch), layer)
    expected = plain.decode(q, kv_cache, plain.build_metadata(batch), layer)
    return out, expected


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
    ("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 1, 48), (16, 2, 64), (8, 4, 256)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 5, 32])  # 5: each block ends in an unpaired token (bfloat16)
def test_kernel_matches_the_pytorch_path(kernel, heads, kv_heads, head_dim, dtype, block_size):
    lengths = [1, 15, 16, 17, 100, 33]
    q, kv_cache, tables, lens = random_step(heads, kv_heads, head_dim, lengths, dtype, block_size)
    layer = AttentionLayerParams(heads, kv_heads, head_dim, head_dim**-0.5)
    out, expected = decode_both_ways(q, kv_cache, tables, lens, layer, block_size)
    expected = expected.float()
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
    layer = AttentionLayerParams(8, 2, 64, 64**-0.5, sliding_window=window, softcap=softcap)
    out, expected = decode_both_ways(q, kv_cache, tables, lens, layer, block_size)
    expected = expected.float()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.float() - expected).abs().max() < tolerance
    plain, _ = decode_both_ways(q, kv_cache, tables, lens, AttentionLayerParams(8, 2, 64, 64**-0.5), block_size)
    assert (plain.float() - expected).abs().max() > 10 * tolerance  # the parameters changed the result


@pytest.mark.parametrize("window", [None, 7])
def test_sinks_in_both_backends_match_transformers(kernel, window):
    """gpt-oss's attention sinks (a logit per head in each softmax's denominator) as a layer
    parameter: both backends' decode rows against transformers' own gpt-oss attention over each
    row's keys (the "cpp" backend hands layers with sinks to the PyTorch decode)."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    heads, kv_heads, dim = 8, 2, 64
    lengths = [1, 7, 15, 17, 40]
    q, kv_cache, tables, lens = random_step(heads, kv_heads, dim, lengths, torch.float32)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(3)) * 2
    layer = AttentionLayerParams(heads, kv_heads, dim, dim**-0.5, sliding_window=window, sinks=sinks)
    out, plain = decode_both_ways(q, kv_cache, tables, lens, layer)
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=heads // kv_heads, training=False)
    for row, length in enumerate(lengths):
        keys, values = (kv_cache[i][tables[row]].reshape(-1, kv_heads, dim)[:length] for i in (0, 1))
        visible = torch.arange(length) > length - 1 - window if window else torch.ones(length, dtype=torch.bool)
        mask = torch.zeros(1, 1, 1, length).masked_fill(~visible, float("-inf"))
        expected, _ = eager_attention_forward(module, q[row][None, :, None], keys.transpose(0, 1)[None],
                                              values.transpose(0, 1)[None], mask, dim**-0.5)
        assert (out[row] - expected[0, 0]).abs().max() < 1e-5
        assert (plain[row] - expected[0, 0]).abs().max() < 1e-5
    no_sinks, _ = decode_both_ways(q, kv_cache, tables, lens, AttentionLayerParams(heads, kv_heads, dim, dim**-0.5,
                                                                                   sliding_window=window))
    assert (no_sinks - out).abs().max() > 1e-3  # the sinks changed the result


@pytest.mark.parametrize("lengths", [[100], [17, 33], [1, 40, 15]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fewer_sequences_than_threads_split_their_kv_heads(kernel, lengths, dtype):
    """A batch smaller than the thread count splits each sequence's KV heads among tasks (8 threads:
    3 KV heads in slices of one; unequal slices of 5 KV heads), each task its heads' slice of the
    pool's rows and of q and out: the same result as the PyTorch path, with and without a window."""
    threads = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        for heads, kv_heads in [(12, 3), (10, 5)]:
            for window in (None, 20):
                q, kv_cache, tables, lens = random_step(heads, kv_heads, 64, lengths, dtype)
                layer = AttentionLayerParams(heads, kv_heads, 64, 0.125, sliding_window=window)
                out, expected = decode_both_ways(q, kv_cache, tables, lens, layer)
                tolerance = 1e-5 if dtype == torch.float32 else 2e-2
                assert (out.float() - expected.float()).abs().max() < tolerance
    finally:
        torch.set_num_threads(threads)


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
    assert engine.runner.attention_backend.name == backend
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
    layer = AttentionLayerParams(9, 3, 64, 64**-0.5)
    out, expected = decode_both_ways(q, pool, tables, lens, layer)
    assert out.dtype == query_dtype
    tolerance = 1e-5 if query_dtype == torch.float32 else 1e-2  # a bfloat16 output's rounding
    assert (out - expected).abs().max() < tolerance
    over_values, _ = decode_both_ways(q, kv_values(pool, 64, query_dtype), tables, lens, layer)
    assert (out - over_values).abs().max() < tolerance


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


def test_one_backend_per_engine_from_the_flag(kernel):
    """--attention-backend names a registry entry; "auto" is the C++ kernel on a CPU where it
    builds; a backend that cannot run on the device is refused by name, as is an unknown name."""
    assert sorted(ATTENTION_BACKENDS) == ["cpp", "torch"]
    from roseinfer.config import ATTENTION_BACKENDS as FLAG_CHOICES

    assert set(FLAG_CHOICES) == {"auto", *ATTENTION_BACKENDS}  # the flag offers each backend
    assert select_attention_backend("auto", CPU, 16).name == "cpp"
    assert select_attention_backend("torch", CPU, 16).name == "torch"
    with pytest.raises(InvalidRequestError, match="'cpp' runs on the CPU only, not meta"):
        select_attention_backend("cpp", torch.device("meta"), 16)
    assert select_attention_backend("auto", torch.device("meta"), 16).name == "torch"
    with pytest.raises(InvalidRequestError, match="attention_backend must be one of auto, cpp, torch; got 'flash'"):
        select_attention_backend("flash", CPU, 16)


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_prefill_then_decode_through_each_backend_matches_plain_attention(kernel, backend):
    """A step with a decode row and two prefill chunks (one over cached tokens), run by a
    backend's `forward` over the metadata its `build_metadata` makes: keys and values land at
    their slots, and every query's output is plain causal attention over its request's keys."""
    generator = torch.Generator().manual_seed(3)
    layer = AttentionLayerParams(4, 2, 32, 32**-0.5, sliding_window=6, softcap=4.0)
    attention = select_attention_backend(backend, CPU, 4)
    pool = torch.zeros(2, 16, 4, 2, 32)
    history = {0: torch.randn(2, 9, 2, 32, generator=generator), 1: torch.randn(2, 5, 2, 32, generator=generator)}
    tables = {0: [3, 7, 1], 1: [9, 2], 2: [5, 6]}
    for request, kv in history.items():  # what earlier steps stored
        for position in range(kv.shape[1]):
            block, offset = tables[request][position // 4], position % 4
            pool[:, block, offset] = kv[:, position]
    # Request 0 decodes position 9; request 1 prefills positions 5..7 over its 5 cached; request 2
    # prefills positions 0..4 from nothing.
    new = {0: 1, 1: 3, 2: 5}
    cached = {0: 9, 1: 5, 2: 0}
    slots, prefills, start = [], [], 1
    for request in (0, 1, 2):
        for position in range(cached[request], cached[request] + new[request]):
            slots.append(tables[request][position // 4] * 4 + position % 4)
    for request in (1, 2):
        prefills.append(PrefillRows(start, new[request], cached[request], torch.tensor(tables[request]).numpy()))
        start += new[request]
    meta = attention.build_metadata(AttentionBatch(
        slot_mapping=torch.tensor(slots).numpy(), decode_block_tables=torch.tensor([tables[0]]).numpy(),
        decode_context_lens=torch.tensor([10]).numpy(), prefills=prefills,
    ))
    assert meta.backend is attention
    q = torch.randn(9, 4, 32, generator=generator)
    k = torch.randn(9, 2, 32, generator=generator)
    v = torch.randn(9, 2, 32, generator=generator)
    out = attention.forward(q, k, v, pool, meta, layer)
    row = 0
    for request in (0, 1, 2):
        keys = torch.cat([history.get(request, torch.zeros(2, 0, 2, 32))[0], k[row : row + new[request]]])
        values = torch.cat([history.get(request, torch.zeros(2, 0, 2, 32))[1], v[row : row + new[request]]])
        for i in range(new[request]):
            position = cached[request] + i
            seen = range(max(0, position - 5), position + 1)  # the window of 6, its own included
            scores = torch.einsum("hd,thd->ht", q[row + i], keys[list(seen)].repeat_interleave(2, 1)) * 32**-0.5
            scores = torch.tanh(scores / 4.0) * 4.0
            expected = torch.einsum("ht,thd->hd", scores.softmax(-1), values[list(seen)].repeat_interleave(2, 1))
            assert (out[row + i] - expected).abs().max() < 1e-5, (backend, request, i)
        row += new[request]
    stored = pool.view(2, -1, 2, 32)[:, torch.tensor(slots)]
    assert torch.equal(stored[0], k) and torch.equal(stored[1], v)
