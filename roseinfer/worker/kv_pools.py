"""Memory for the per-sequence pools (the KV cache's blocks, recurrent state slots) committed only
where it is written."""

from __future__ import annotations

import math
import mmap

import torch


def zeroed_untouched(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose memory is only committed where it is written (the KV pool: padded
    attention reads unused slots, so they must hold zeros, not NaN garbage). On the CPU it is an
    anonymous mapping: its pages are zero without being touched, so a large pool costs nothing
    until used (torch.zeros would write every page at start).

    In 4 KiB pages, not huge ones: a block of one layer's keys is a few KiB (6 KiB for the
    default model), and with 2 MiB pages (numpy asks for them on large arrays) the first block
    written in each layer's K and V halves commits 2 MiB: +100 MiB of peak RSS over the shared
    64-request workload in bfloat16 KV."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    pages = mmap.mmap(-1, max(count * dtype.itemsize, 1), flags=mmap.MAP_PRIVATE)  # anonymous, not shared
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux; elsewhere no huge pages unless asked for
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)  # keeps `pages` alive
