"""Memory probes for a server under the soak (tests/soak_memory/rounds.py), loaded by Python at
start-up when this directory is on PYTHONPATH; inert unless ROSEINFER_MEMDEBUG names a directory.

SIGUSR1: count live Python objects by type (and, with ROSEINFER_TRACEMALLOC=FRAMES set, save a
tracemalloc snapshot) into that directory. SIGUSR2: glibc's malloc_trim(0), which returns freed
heap pages to the kernel: what it gives back was free memory glibc kept, not a leak.
"""

import os

_DIR = os.environ.get("ROSEINFER_MEMDEBUG")

if _DIR:
    import collections
    import ctypes
    import gc
    import json
    import signal
    import tracemalloc

    if os.environ.get("ROSEINFER_TRACEMALLOC"):
        tracemalloc.start(int(os.environ["ROSEINFER_TRACEMALLOC"]))
    _dumps = [0]

    def _dump(signum, frame):
        _dumps[0] += 1
        gc.collect()
        report = {"types": collections.Counter(type(o).__qualname__ for o in gc.get_objects()).most_common(300)}
        if tracemalloc.is_tracing():
            snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
            snapshot.dump(f"{_DIR}/snap{_dumps[0]}.tm")
            report["traced"] = tracemalloc.get_traced_memory()
        with open(f"{_DIR}/dump{_dumps[0]}.json.tmp", "w") as handle:
            json.dump(report, handle)
        os.rename(f"{_DIR}/dump{_dumps[0]}.json.tmp", f"{_DIR}/dump{_dumps[0]}.json")

    def _trim(signum, frame):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        open(f"{_DIR}/trim{_dumps[0]}", "w").close()

    signal.signal(signal.SIGUSR1, _dump)
    signal.signal(signal.SIGUSR2, _trim)
