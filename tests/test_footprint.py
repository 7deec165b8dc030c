"""Resident memory: what loading, the KV pool and importing the server cost.

Each measurement runs in a fresh Python process, so that nothing else of the test session is in
its resident set. The bounds are far from the figures measured (in the comments) and far below
what each regression they guard against would cost.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

MIB = 1024 * 1024

# Prints the process's resident set (and its high-water mark) after the given code, in bytes.
_MEASURE = """
import json
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(key)
{code}
print(json.dumps({{"rss": status("VmRSS"), "hwm": status("VmHWM"), **extra}}))
"""


def measure(code: str) -> dict:
    script = _MEASURE.format(code=code)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_kv_pool_commits_only_the_pages_written() -> None:
    # 30 layers of 64 MiB each; one 6 KiB block written in each layer's keys and values. In 4 KiB
    # pages that commits ~0.5 MiB; in 2 MiB huge pages it was 120 MiB.
    figures = measure("""
import torch
from roseinfer.worker.kv_pools import zeroed_untouched
before = status("VmRSS")
pools = [zeroed_untouched((2, 5461, 16, 3, 64), torch.bfloat16, torch.device("cpu")) for _ in range(30)]
after_alloc = status("VmRSS")
for pool in pools:
    pool[0, 2000] = 1.0
    pool[1, 2000] = 1.0
extra = {"alloc": after_alloc - before, "written": status("VmRSS") - after_alloc,
         "zeros": all(float(pool.float().abs().sum()) == 2 * 16 * 3 * 64 for pool in pools[:2])}
""")
    assert figures["zeros"], "the pool must read back as zeros except where written"
    assert figures["alloc"] < 8 * MIB, f"allocating the pool committed {figures['alloc'] / MIB:.1f} MiB"
    assert figures["written"] < 16 * MIB, f"writing 60 blocks committed {figures['written'] / MIB:.1f} MiB"


def test_server_imports_leave_out_the_compiler_stack() -> None:
    # llguidance.torch imports torch._inductor (~120 MB resident, 2 s); the server uses the numpy
    # helpers of llguidance instead.
    figures = measure("""
import sys
import roseinfer.server.app
import roseinfer.engine.llm
extra = {"inductor": "torch._inductor" in sys.modules}
""")
    assert not figures["inductor"]


# float32: peak 872 MiB for 738 once loaded (134 above); it was 1,334 (489 above) while every
# original weight stayed alive until the last layer had its prepacked copy, and the embedding table
# was dequantized and re-blocked whole. int4: peak 558 for 403 (155 above); it was 946 (543 above)
# while every layer was loaded in float32 before any was quantized (now each is, once loaded).
@pytest.mark.parametrize(("quantization", "bound_mib"), [("none", 250), ("int4", 300)])
def test_loading_peaks_near_the_loaded_model(quantization: str, bound_mib: int) -> None:
    figures = measure(f"""
import torch
from roseinfer.models.loader import load_model, release_free_memory
loaded = load_model(None, None, torch.device("cpu"), torch.float32, {quantization!r})
release_free_memory()
extra = {{}}
""")
    transient = figures["hwm"] - figures["rss"]
    assert transient < bound_mib * MIB, f"loading peaked {transient / MIB:.0f} MiB above the loaded model"


def test_reading_a_gguf_file_leaves_its_pages_out_of_the_resident_set() -> None:
    # every tensor of the default model read: the file's own mapping keeps ~0 MiB resident; it kept
    # ~88 (the whole file stayed in the resident set, on top of the loaded weights, until the reader
    # was dropped). Only the file's mapping is counted: first calls into torch and numpy fault in
    # their libraries' code pages too (+1 MiB here, +36 on a machine with a cold page cache).
    figures = measure("""
from roseinfer.models.default_model import default_model_path
from roseinfer.models.gguf_file import GGUFFile
def file_resident(path):
    resident, inside = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            inside = len(fields) >= 6 and fields[5] == path
        elif inside and fields[0] == "Rss:":
            resident += int(fields[1]) * 1024
    return resident
path = str(default_model_path().resolve())
gguf = GGUFFile(path)
before = file_resident(path)
total = sum(gguf.load_tensor(name).numel() for name in gguf.tensor_names())
extra = {"file_growth": file_resident(path) - before, "total": total}
""")
    assert figures["total"] > 100_000_000  # the whole model was read
    assert figures["file_growth"] < 8 * MIB, f"the file's pages added {figures['file_growth'] / MIB:.0f} MiB"


def test_prefill_activations_leave_the_resident_set() -> None:
    # 4 prompts of ~2,700 tokens, prefilled in chunks: the float32 activations of a chunk (tens of
    # MiB) are freed into the heap after each step. Returned to the system after every step with a
    # prefill, the resident set grows by the KV pages written (q8_0: 12.2 KB a token) plus ~8 MiB;
    # kept in the heap, it grew by the KV pages plus 125-140 MiB (8 prompts; measured with the
    # trim switched off).
    figures = measure("""
from roseinfer import LLM, SamplingParams
llm = LLM(kv_cache_dtype="q8_0", kv_cache_memory=0.25)
text = " ".join(f"word{i}" for i in range(700))
prompts = [f"{i} {text}" for i in range(4)]
llm.generate(["warm up"], SamplingParams(max_tokens=2), use_tqdm=False)
before = status("VmRSS")
llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
tokens = sum(len(llm.llm_engine.tokenizer.encode(p)) for p in prompts)
import torch
extra = {"growth": status("VmRSS") - before, "kv": tokens * llm.llm_engine.model_config.kv_block_bytes(1, torch.int8)}
""")
    beyond_kv = figures["growth"] - figures["kv"]
    assert beyond_kv < 40 * MIB, f"a prefill left {beyond_kv / MIB:.0f} MiB resident beyond its KV pages"
