"""llama.cpp's own figures on the same text: runs its `llama-perplexity` and reads what it reports.

Two runs, as llama.cpp's documentation describes them: the F32 model writes its next-token
log-probabilities to a base file (`--kl-divergence-base`), then the quantized file is scored
against it (`--kl-divergence`). The base file also holds the token ids llama.cpp evaluated, so
the caller can check that both tokenizers cut the text the same way, and its log-probabilities
(stored as 16-bit codes with a scale and a minimum per position) let our float32 be compared
with llama.cpp's F32 directly.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from roseinfer.bench.corpus import ScoredSpan

_MAGIC = b"_logits_"
_NUMBER = r"([-+0-9.eE]+|nan|inf)"
_PATTERNS = {  # llama-perplexity's result lines (--kl-divergence run)
    "perplexity": rf"Mean PPL\(Q\)\s*:\s*{_NUMBER}",
    "base_perplexity": rf"Mean PPL\(base\)\s*:\s*{_NUMBER}",
    "mean_kld": rf"Mean\s+KLD:\s*{_NUMBER}\s*±\s*{_NUMBER}",
    "kld_p99": rf"99\.0%\s+KLD:\s*{_NUMBER}",
    "same_top": rf"Same top p:\s*{_NUMBER}",
}


@dataclass
class LlamaFigures:
    base_perplexity: float  # the F32 model's, from the base run
    perplexity: float  # the quantized file's
    mean_kld: float
    mean_kld_stderr: float
    kld_p99: float
    same_top: float  # fraction
    commands: list[list[str]]


def _run(command: list[str]) -> str:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        tail = "\n".join(output.splitlines()[-20:])
        raise RuntimeError(f"{' '.join(command)} failed with exit status {result.returncode}:\n{tail}")
    return output


def _find(pattern: str, output: str, what: str) -> re.Match[str]:
    match = re.search(pattern, output)
    if match is None:
        raise RuntimeError(f"llama-perplexity printed no {what} (pattern {pattern!r}); is this llama.cpp too old?")
    return match


_BASE_RUNS: dict[tuple, str] = {}


def run_llama_perplexity(
    binary: Path, f32_gguf: Path, quantized_gguf: Path, corpus: Path, n_ctx: int,
    max_chunks: int | None, threads: int, base_file: Path,
) -> LlamaFigures:
    common = ["-c", str(n_ctx), "-t", str(threads)]
    if max_chunks is not None:
        common += ["--chunks", str(max_chunks)]
    base_run = [str(binary), "-m", str(f32_gguf), "-f", str(corpus), *common, "--kl-divergence-base", str(base_file)]
    base_output = _BASE_RUNS.get((tuple(base_run), base_file.stat().st_mtime if base_file.exists() else None))
    if base_output is None:  # one base run serves every quantized file of a session
        base_output = _run(base_run)
        _BASE_RUNS[(tuple(base_run), base_file.stat().st_mtime)] = base_output
    base_ppl = float(_find(rf"Final estimate: PPL = {_NUMBER}", base_output, "final PPL estimate").group(1))
    kld_run = [str(binary), "-m", str(quantized_gguf), *common, "--kl-divergence-base", str(base_file),
               "--kl-divergence"]
    output = _run(kld_run)
    found = {name: _find(pattern, output, name) for name, pattern in _PATTERNS.items()}
    return LlamaFigures(
        base_perplexity=base_ppl,
        perplexity=float(found["perplexity"].group(1)),
        mean_kld=float(found["mean_kld"].group(1)),
        mean_kld_stderr=float(found["mean_kld"].group(2)),
        kld_p99=float(found["kld_p99"].group(1)),
        same_top=float(found["same_top"].group(1)) / 100.0,
        commands=[base_run, kld_run],
    )


class LlamaBaseFile:
    """The base file of `--kl-divergence-base`: a header, the evaluated tokens, then per chunk the
    log-probabilities of its scored positions."""

    def __init__(self, path: Path) -> None:
        with path.open("rb") as handle:
            if handle.read(8) != _MAGIC:
                raise ValueError(f"{path} is not a llama-perplexity log-probability file")
            self.n_ctx = int(np.frombuffer(handle.read(4), dtype=np.uint32)[0])
            self.n_vocab, self.n_chunk = (int(x) for x in np.frombuffer(handle.read(8), dtype=np.int32))
            self.tokens = np.frombuffer(handle.read(4 * self.n_ctx * self.n_chunk), dtype=np.int32)
            header = handle.tell()
        # Each position: two float32 (scale, minimum log-prob) as four uint16, then n_vocab codes,
        # padded to an even count.
        self._row = 2 * ((self.n_vocab + 1) // 2) + 4
        self._span = ScoredSpan(self.n_ctx)
        rows = self._span.num_scored * self.n_chunk
        self._codes = np.memmap(path, dtype=np.uint16, mode="r", offset=header, shape=(rows, self._row))

    def log_probs(self, chunk: int) -> torch.Tensor:
        """[scored positions, n_vocab] float32 log-probabilities of one chunk, decoded."""
        if not 0 <= chunk < self.n_chunk:
            raise IndexError(f"chunk {chunk} out of range (the file has {self.n_chunk})")
        per_chunk = self._span.num_scored
        codes = np.asarray(self._codes[chunk * per_chunk : (chunk + 1) * per_chunk])
        scale_and_min = codes[:, :4].copy().view(np.float32)  # [rows, 2]
        values = codes[:, 4 : 4 + self.n_vocab].astype(np.float32)
        decoded = values * scale_and_min[:, :1] + scale_and_min[:, 1:2]
        return torch.from_numpy(decoded)
