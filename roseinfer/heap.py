"""Giving the malloc heap's free pages back to the system (glibc; elsewhere there is nothing to do).

Freed memory stays in the process's heap, and resident, until something reuses it or it is
trimmed: loading (file buffers, dequantized copies, float weights replaced by packed ones) and a
prefill's activations free far more than the decode steps after them reuse.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


def trim_heap() -> None:
    """Return the malloc heaps' free pages to the system."""
    malloc_trim = _malloc_trim()
    if malloc_trim is not None:
        malloc_trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, looked up once (the model runner calls it after every prefill)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None
