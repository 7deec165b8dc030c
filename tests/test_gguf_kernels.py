"""The GGUF block kernels (csrc/gguf_blocks.h, gguf_linear_cpu.cpp) on random blocks of every type
they run, against `gguf`'s own numpy dequantization:

- repacking is lossless, and the values the kernels expand are exactly gguf's, bit for bit;
- exact linear layers equal the product of those values (float64 reference);
- the fast path equals the same product with the activations rounded as it documents: 8 bits per
  32 or 256 values for small batches (VNNI builds), bfloat16 inputs for large ones (AVX512-BF16);
- weights packed to be kept (`lasting`) are the same bytes, in memory advised for 2 MiB pages.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from gguf_blocks import BLOCK_TYPES, random_blocks

from roseinfer.layers.cpu_kernels import cpu_has_bfloat16_dot_products, cpu_kernels

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the C++ CPU kernels could not be built")

SUPER_BLOCK_TYPES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"}
DOT_ROWS = 32  # gguf_linear_cpu.cpp's kDotRows: up to here the dot kernels, past it panels


def columns_of(name: str) -> int:
    # 32-value types: 23 blocks, so the last group of 4 is padded; 256-value types: 3 super-blocks.
    return 768 if name in SUPER_BLOCK_TYPES else 736


def weight(name: str, rows: int = 37, seed: int = 1):
    """(file bytes, gguf's values, the kernels' packed weight, its kernel type)."""
    columns = columns_of(name)
    raw = random_blocks(name, rows, columns, seed=seed)
    qtype = GGMLQuantizationType[name]
    values = dequantize(raw, qtype).reshape(rows, columns).astype(np.float32)
    packed, kernel_type = kernels.gguf_pack(torch.from_numpy(raw), int(qtype), columns)
    return raw, values, packed, kernel_type


# 37 rows: the row layout; 48 (a multiple of 8 and of 16): the interleaved one where a type has it.
ROW_COUNTS = [37, 48]


@pytest.mark.parametrize("name", BLOCK_TYPES)
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_repacking_is_lossless_and_expanded_values_are_ggufs_exactly(name, rows):
    raw, values, packed, qtype = weight(name, rows)
    assert kernels.gguf_types().count(int(GGMLQuantizationType[name])) == 1
    assert np.array_equal(kernels.gguf_unpack(packed, qtype, values.shape[1]).numpy(), raw)
    expanded = kernels.gguf_dequantize(packed, qtype, values.shape[1]).numpy()
    assert np.array_equal(expanded.view(np.uint32), values.view(np.uint32)), "not bit for bit"
    ids = torch.tensor([5, 0, rows - 1, 5])
    rows = kernels.gguf_dequantize(packed, qtype, values.shape[1], ids).numpy()
    assert np.array_equal(rows.view(np.uint32), values[ids.numpy()].view(np.uint32))
    as_bf16 = kernels.gguf_dequantize(packed, qtype, values.shape[1], None, torch.bfloat16)
    assert torch.equal(as_bf16, torch.from_numpy(values).to(torch.bfloat16))


def relative_error(result: torch.Tensor, reference: np.ndarray) -> float:
    return float(np.abs(result.double().numpy() - reference).max() / np.abs(reference).max())


@pytest.mark.parametrize("name", BLOCK_TYPES)
@pytest.mark.parametrize("weight_rows", ROW_COUNTS)
@pytest.mark.parametrize("rows", [1, 3, 5, 40])
def test_exact_products_equal_the_expanded_weight_times_x(name, weight_rows, rows):
    _, values, packed, qtype = weight(name, weight_rows)
    x = torch.randn(rows, values.shape[1], generator=torch.Generator().manual_seed(rows))
    reference = x.double().numpy() @ values.astype(np.float64).T
    out = kernels.gguf_linear(x, [packed], [qtype], None, True)
    assert out.shape == (rows, values.shape[0]) and out.dtype == torch.float32
    assert relative_error(out, reference) < 2e-6


def quantized_rows(x: np.ndarray, block: int) -> np.ndarray:
    """x rounded as the kernels quantize activations: per run of `block` values a scale
    max|x| / 127 and codes round(x * 127 / max|x|), ties to even (all in float32)."""
    runs = x.astype(np.float32).reshape(x.shape[0], -1, block)
    amax = np.abs(runs).max(-1, keepdims=True)
    inverse = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    codes = np.clip(np.rint(runs * inverse), -127, 127)
    return (codes * (amax / np.float32(127))).reshape(x.shape).astype(np.float64)


@pytest.mark.parametrize("name", BLOCK_TYPES)
@pytest.mark.parametrize("weight_rows", ROW_COUNTS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, DOT_ROWS])
def test_small_batches_multiply_8_bit_activations(name, weight_rows, rows):
    _, values, packed, qtype = weight(name, weight_rows)
    x = torch.randn(rows, values.shape[1], generator=torch.Generator().manual_seed(10 + rows))
    out = kernels.gguf_linear(x, [packed], [qtype], None, False)
    if kernels.gguf_kernel_isa() == "avx512-vnni":
        xq = quantized_rows(x.numpy(), 256 if name in SUPER_BLOCK_TYPES else 32)
    else:  # no VNNI: float activations, exact products
        xq = x.double().numpy()
    reference = xq @ values.astype(np.float64).T
    assert relative_error(out, reference) < 2e-6
    # and near the exact product: 8 bits a value cost ~1% here (random Gaussian activations)
    assert relative_error(out, x.double().numpy() @ values.astype(np.float64).T) < 0.03


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS", "MXFP4"])
@pytest.mark.parametrize("weight_rows", ROW_COUNTS)
def test_large_batches_multiply_8_bit_or_bfloat16_inputs(name, weight_rows):
    """Past DOT_ROWS rows of x the interleaved layouts (VNNI builds) keep their 8-bit products;
    the row layout expands panels and multiplies bfloat16 inputs where the CPU has them."""
    _, values, packed, qtype = weight(name, weight_rows)
    x = torch.randn(DOT_ROWS + 25, values.shape[1], generator=torch.Generator().manual_seed(3))
    out = kernels.gguf_linear(x, [packed], [qtype], None, False)
    if qtype >= 256:  # an interleaved layout's kernel type: GGML type + 256
        xq = quantized_rows(x.numpy(), 256 if name in SUPER_BLOCK_TYPES else 32)
        reference = xq @ values.astype(np.float64).T
    elif cpu_has_bfloat16_dot_products() and "bfloat16" in kernels.panel_linear_dtypes():
        as_bf16 = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float32)).to(torch.bfloat16).double().numpy()  # noqa: E731
        reference = as_bf16(x.numpy()) @ as_bf16(values).T
    else:
        reference = x.double().numpy() @ values.astype(np.float64).T
    assert relative_error(out, reference) < 2e-6


@pytest.mark.parametrize(("name", "columns"), [("Q4_K", 4608), ("Q8_0", 2336)])
def test_large_batches_over_long_rows_sum_the_row_in_slices(name, columns):
    """Past 2048 inputs a panel covers a slice of them at a time and the slices' products add up."""
    raw = random_blocks(name, 56, columns, seed=5)
    qtype = GGMLQuantizationType[name]
    values = dequantize(raw, qtype).reshape(56, columns).astype(np.float64)
    packed, kernel_type = kernels.gguf_pack(torch.from_numpy(raw), int(qtype), columns)
    x = torch.randn(DOT_ROWS + 8, columns, generator=torch.Generator().manual_seed(6))
    exact = kernels.gguf_linear(x, [packed], [kernel_type], None, True)
    assert relative_error(exact, x.double().numpy() @ values.T) < 5e-6


def test_every_mxfp4_scale_expands_as_ggufs():
    """MXFP4's E8M0 scale byte, all 256 of them (2^-128, subnormal, up to 2^127, whose largest
    values overflow to infinity in gguf's float32 too), under every code, bit for bit."""
    blocks = np.zeros((256, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(256)
    codes = np.arange(16)
    blocks[:, 1:] = (codes | (15 - codes) << 4).astype(np.uint8)  # every code, in both nibbles
    rows = blocks.reshape(64, 4 * 17)  # 64 rows of 128 values
    qtype = GGMLQuantizationType.MXFP4
    with np.errstate(over="ignore"):
        values = dequantize(rows, qtype).reshape(64, 128).astype(np.float32)
    packed, kernel_type = kernels.gguf_pack(torch.from_numpy(rows), int(qtype), 128)
    expanded = kernels.gguf_dequantize(packed, kernel_type, 128).numpy()
    assert np.array_equal(expanded.view(np.uint32), values.view(np.uint32))


def test_mxfp4_blocks_that_ggufs_own_quantizer_writes():
    """Float weights quantized to MXFP4 by gguf-py (`gguf.quants.quantize`, the blocks a converter
    writes): the kernels expand gguf's values, and their products (8-bit activations on VNNI
    builds, decode and prefill batches) are those of the expanded weight."""
    from gguf.quants import quantize

    weights = np.random.default_rng(7).standard_normal((48, 512)).astype(np.float32) * 0.05
    qtype = GGMLQuantizationType.MXFP4
    raw = quantize(weights, qtype)
    values = dequantize(raw, qtype).astype(np.float32)
    assert np.abs(values - weights).max() < 0.25 * np.abs(weights).max()  # it is a quantization of them
    packed, kernel_type = kernels.gguf_pack(torch.from_numpy(raw), int(qtype), 512)
    assert np.array_equal(kernels.gguf_dequantize(packed, kernel_type, 512).numpy(), values)
    for rows in (1, 4, DOT_ROWS + 9):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        exact = kernels.gguf_linear(x, [packed], [kernel_type], None, True)
        assert relative_error(exact, x.double().numpy() @ values.astype(np.float64).T) < 2e-6
        fast = kernels.gguf_linear(x, [packed], [kernel_type], None, False)
        assert relative_error(fast, x.double().numpy() @ values.astype(np.float64).T) < 0.03


def test_parts_of_different_types_stack_along_the_outputs_with_a_bias():
    parts = [weight("Q4_K", rows=16, seed=1), weight("Q6_K", rows=16, seed=2), weight("Q4_K", rows=5, seed=3)]
    assert [p[3] for p in parts] == [12 + 256, 14 + 256, 12] or kernels.gguf_kernel_isa() != "avx512-vnni"
    x = torch.randn(3, 768, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(37)
    out = kernels.gguf_linear(x, [p[2] for p in parts], [p[3] for p in parts], bias, True)
    stacked = np.concatenate([p[1] for p in parts]).astype(np.float64)
    assert relative_error(out, x.double().numpy() @ stacked.T + bias.double().numpy()) < 2e-6
    x16 = x.to(torch.bfloat16)
    assert kernels.gguf_linear(x16, [p[2] for p in parts], [p[3] for p in parts], bias, True).dtype == torch.bfloat16


def mapping_flags(address: int) -> set[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first, _, rest = line.partition(" ")
        if "-" in first and ":" not in first:  # a mapping's header: start-end perms ...
            start, end = (int(part, 16) for part in first.split("-"))
            inside = start <= address < end
        elif inside and first == "VmFlags:":
            return set(rest.split())
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
                    reason="no transparent huge pages in this kernel")
@pytest.mark.parametrize("name, rows", [("Q4_K", 48), ("Q4_K", 37), ("Q4_1", 37), ("Q6_K", 48)])
def test_weights_kept_for_the_model_are_the_same_bytes_in_huge_page_memory(name, rows):
    raw, values, temporary, kernel_type = weight(name, rows)
    kept, kept_type = kernels.gguf_pack(torch.from_numpy(raw), int(GGMLQuantizationType[name]), values.shape[1],
                                        lasting=True)
    assert kept_type == kernel_type and torch.equal(kept, temporary)
    if kept.data_ptr() != raw.ctypes.data:  # a copy (a 256-value type's row layout is the file's bytes)
        assert "hg" in mapping_flags(kept.data_ptr()), "a lasting weight is not in memory advised huge"
    del temporary, raw
    out = kernels.gguf_linear(torch.ones(1, values.shape[1]), [kept], [kept_type], None, True)
    assert relative_error(out, values.sum(axis=1, dtype=np.float64)[None]) < 2e-6
    if "float32" in kernels.panel_linear_dtypes():
        panels = kernels.pack_panels(torch.from_numpy(values))
        assert "hg" in mapping_flags(panels.data_ptr())


def test_bad_weights_are_named():
    _, values, packed, qtype = weight("Q4_K")
    with pytest.raises(RuntimeError, match="multiple of 256"):
        kernels.gguf_pack(torch.zeros(2, 144, dtype=torch.uint8), qtype, 300)
    with pytest.raises(RuntimeError, match="bytes a row"):
        kernels.gguf_linear(torch.randn(1, 512), [packed], [qtype], None, False)
    if kernels.gguf_kernel_isa() == "avx512-vnni":
        _, _, interleaved, kernel_type = weight("Q4_K", rows=48)
        with pytest.raises(RuntimeError, match="multiple of 16"):
            kernels.gguf_linear(torch.randn(1, 768), [interleaved[:12]], [kernel_type], None, False)
    with pytest.raises(RuntimeError, match="GGML type 16 has no kernel"):
        kernels.gguf_row_bytes(16, 256)  # IQ2_XXS
    from roseinfer.layers.quantization.gguf import supported_type_names

    assert "MXFP4" in supported_type_names().split(", ")  # the list a load error names


AVX2_CHECK = r"""
import numpy as np, torch, sys
sys.path.insert(0, "tests")
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from gguf_blocks import BLOCK_TYPES, random_blocks
from roseinfer.layers.cpu_kernels import cpu_kernels
k = cpu_kernels()
assert k is not None and k.gguf_kernel_isa() == "float" and k.panel_linear_dtypes() == [], "not an AVX2-only build"
for name in BLOCK_TYPES:
    columns = 768 if name.endswith("_K") or name == "IQ4_XS" else 736
    raw = random_blocks(name, 40, columns)
    values = dequantize(raw, GGMLQuantizationType[name]).reshape(40, columns).astype(np.float32)
    packed, kernel_type = k.gguf_pack(torch.from_numpy(raw), int(GGMLQuantizationType[name]), columns)
    assert np.array_equal(k.gguf_dequantize(packed, kernel_type, columns).numpy(), values), name
    for rows in (1, 5, 40):
        x = torch.randn(rows, columns)
        out = k.gguf_linear(x, [packed], [kernel_type], None, False).double().numpy()
        reference = x.double().numpy() @ values.astype(np.float64).T
        assert np.abs(out - reference).max() < 2e-6 * np.abs(reference).max(), (name, rows)
from roseinfer import LLM, SamplingParams
outputs = LLM(sys.argv[1], num_kv_blocks=32).generate(
    prompt_token_ids=[[5, 9, 30]], sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    use_tqdm=False)
print(outputs[0].outputs[0].token_ids)
"""


@pytest.mark.skipif(not {"avx2", "fma", "f16c", "bmi2"} <= set(__import__("roseinfer.layers.cpu_kernels",
                    fromlist=["cpu_flags"]).cpu_flags()), reason="this CPU cannot run an AVX2 build")
def test_an_avx2_only_build_runs_every_type_exactly(tmp_path):
    """The kernels built for an AVX2-only CPU (-march=x86-64-v3: no AVX-512, no VNNI, no panel
    kernel): every block type expands and multiplies exactly (float activations), and a model in
    its own blocks generates what the native build generates with exact products."""
    import os
    import subprocess
    import sys

    from support import tiny_hf_model, write_llama_gguf

    from roseinfer import LLM, SamplingParams

    original = tiny_hf_model("llama-256", tmp_path / "hf")
    path = tmp_path / "tiny-Q4_K.gguf"
    write_llama_gguf(original, tmp_path / "hf", path, "llama", "Q4_K", random_blocks=True)
    env = os.environ | {"ROSEINFER_CPU_MARCH": "x86-64-v3"}
    result = subprocess.run([sys.executable, "-c", AVX2_CHECK, str(path)], env=env, capture_output=True, text=True,
                            timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    avx2_tokens = eval(result.stdout.strip().splitlines()[-1])  # a list of ints, printed by the check
    exact = LLM(str(path), num_kv_blocks=32, quantization="none").generate(
        prompt_token_ids=[[5, 9, 30]], sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False)
    assert avx2_tokens == exact[0].outputs[0].token_ids
