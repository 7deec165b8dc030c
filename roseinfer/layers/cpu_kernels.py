"""roseinfer's own C++ kernels for the CPU, compiled on first use by PyTorch's extension builder.

- Decode attention: the plain PyTorch path gathers every sequence's blocks into a padded copy,
  then runs SDPA over it, reading the KV cache three times; the kernel reads it once, straight
  through the block tables (2-3x faster at batch 64 here).
- RMSNorm and the residual add before it in one pass (PyTorch runs ~6 small kernels for them);
  rotary embedding in place in one pass (PyTorch: four); the step's new keys and values stored
  in the pool in one pass (PyTorch: two index_copy_); SiLU(gate) * up in one pass (PyTorch: a
  SiLU, a product and a temporary); greedy sampling's argmax of each row of the logits.
- Linear layers on GGUF-typed weights (Q4_0 ... Q6_K, IQ4_NL, IQ4_XS, MXFP4) in the file's own codes: one
  driver over per-type block traits (gguf_blocks.h, gguf_linear_cpu.cpp), 8-bit activations for
  small batches where the CPU has VNNI, weights expanded a panel at a time for large ones.
- float32 and bfloat16 linear layers on CPUs with AVX-512 but no AMX (panel_linear_cpu.cpp):
  1.1-1.75x oneDNN at decode batch sizes, 1.4-2.6x for one row.
- A whole decode step of a pre-norm decoder (Llama, Qwen, Gemma, mixtures of experts) with such
  weights in one call (decoder_step_cpu.cpp).
- Weight memory (weight_memory_cpu.cpp): packed weights in 2 MiB pages, which PyTorch's allocator
  does not ask for; a decode step streams every weight once, and in 4 KiB pages a one-stream
  OLMoE-shaped decode ran 39 tok/s against 44.

Building needs a C++ compiler and takes ~30 s once; the result is cached by PyTorch
(TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions). Where it cannot be built the engine
keeps the PyTorch paths.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in ("bindings.cpp", "paged_attention_cpu.cpp", "kv_write_cpu.cpp", "norm_cpu.cpp", "rotary_cpu.cpp",
                 "activation_cpu.cpp", "argmax_cpu.cpp", "panel_linear_cpu.cpp",
                 "gguf_linear_cpu.cpp", "decoder_step_cpu.cpp", "weight_memory_cpu.cpp")
]
# -march=native: the build is for this CPU; its name carries the CPU's feature flags so a cache
# shared with another machine never loads code built for different instructions.
# -ffast-math lets the compiler vectorise the dot-product reductions and call the vector exp of
# glibc's libmvec; the kernel never produces or compares infinities or NaNs, which it assumes.
# -mprefer-vector-width=512: GCC's default for these CPUs is 256-bit vectors.
# -fopenmp: ATen's parallel_for is an inline OpenMP region in the kernels' own code; without the
# flag it compiles to a serial loop (every kernel ran on one core until this was found). PyTorch's
# own libgomp is the one loaded, so the kernels share its thread pool.
# ROSEINFER_CPU_MARCH=<gcc -march value> builds for another instruction set than this CPU's (one
# this CPU runs): x86-64-v3 is an AVX2-only machine's, which is how the tests check the paths
# that run without AVX-512 (test_gguf_kernels.py).
_MARCH = os.environ.get("ROSEINFER_CPU_MARCH", "native")
_FLAGS = ["-O3", f"-march={_MARCH}", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp"]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        line = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def cpu_has_bfloat16_dot_products() -> bool:
    """AVX512-BF16 or AMX: bfloat16 matrix products at least twice float32's speed."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def _cpu_fingerprint() -> str:
    try:
        flags = next(
            (line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), ""
        )
    except OSError:
        flags = ""
    return hashlib.sha1(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


def _source_fingerprint() -> str:
    """Changes with any source, header or flag, so an edited header rebuilds the module too (PyTorch
    tracks the listed sources only), and with the checkout's path: two checkouts never share a build."""
    digest = hashlib.sha1(" ".join(_FLAGS).encode())
    # and with the checkout: PyTorch's build file names the sources by their paths, so two
    # checkouts of the same sources sharing a build directory would each rebuild it for the other.
    digest.update(str(Path(__file__).resolve().parent).encode())
    for path in sorted((Path(__file__).parent / "csrc").iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:8]


# One compiler process needs up to ~1.5 GiB for these sources (the GGUF driver's templates).
_GIB_PER_COMPILE_JOB = 2


def _compile_jobs() -> int:
    """Parallel compiles for the build: PyTorch's default (cores + 2) ran 4 compilers of ~1.5 GiB
    on a 2-core machine, and several checkouts building at once exhausted its memory."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
        available_kib = int(next(line.split()[1] for line in meminfo.splitlines() if line.startswith("MemAvailable")))
    except (OSError, StopIteration, ValueError):
        return 1
    by_memory = available_kib // (_GIB_PER_COMPILE_JOB * 1024 * 1024)
    return max(1, min(os.cpu_count() or 1, by_memory))


@contextlib.contextmanager
def _one_build_at_a_time(build_directory: Path) -> Iterator[None]:
    """Builds of several checkouts or servers starting together wait for each other (a lock file in
    the extensions directory): each build already uses every core it may, and together they ran the
    machine out of memory. A module already built loads without waiting for anyone's build.

    Holding this lock also tells a killed build's leftovers apart: PyTorch's builder takes a lock
    file of its own in the build directory and waits for it with no time limit, and a build killed
    midway (a Ctrl-C on the first start) leaves it behind. Every roseinfer build holds this lock
    (an flock, released when its process dies), so such a file found here is a leftover."""
    if (build_directory / f"{build_directory.name}.so").exists():
        yield
        return
    build_directory.parent.mkdir(parents=True, exist_ok=True)
    with open(build_directory.parent / "roseinfer-kernel-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        leftover = build_directory / "lock"
        if leftover.exists():
            logger.warning("removing %s, left by an interrupted kernel build", leftover)
            leftover.unlink(missing_ok=True)
        previous = os.environ.get("MAX_JOBS")
        os.environ["MAX_JOBS"] = previous or str(_compile_jobs())  # read by PyTorch's ninja call
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop("MAX_JOBS", None)


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled module (`paged_decode_attention`, `rms_norm`, `fused_add_rms_norm`, `gguf_linear`, ...), or None
    where it cannot be built."""
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        name = f"roseinfer_cpu_kernels_{_cpu_fingerprint()}_{_source_fingerprint()}"
        started = time.perf_counter()
        with _one_build_at_a_time(Path(_get_build_directory(name, verbose=False))):
            module = load(
                name=name,
                sources=[str(source) for source in _SOURCES],
                extra_cflags=_FLAGS,
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Exception as exc:  # no compiler, no ninja, an unusual platform: keep the PyTorch path
        logger.warning("the C++ CPU kernels could not be built (%s); using PyTorch's", exc)
        return None
    elapsed = time.perf_counter() - started
    if elapsed > 2:
        logger.info("built the C++ CPU kernels in %.0fs (cached for later runs)", elapsed)
    return module
