"""Keep freed host memory for reuse instead of handing it back to the OS after every step.

glibc's malloc gives each thread but the main one its own arena, and shrinks an arena's heap
whenever its free top passes the trim threshold; a CPU forward that runs off the main thread
(the forward thread of ``scheduler.overlap``, a replica's engine thread) therefore frees its
activations back to the OS at the end of each step and page-faults them in again at the
next, which makes the step measurably slower than on the main thread (BENCHMARKS.md).
``retain_freed_memory()`` raises the trim threshold to 1 GiB and fixes the mmap threshold at
32 MiB (glibc's largest: larger blocks come from the heap, not a fresh mapping each time),
once per process: the faults go, at the cost of up to that much freed memory kept per arena.
A no-op where the C library has no ``mallopt`` (not glibc).
"""

from __future__ import annotations

import ctypes
import threading

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 1 << 30
MMAP_THRESHOLD = 32 << 20

_lock = threading.Lock()
_done: list[bool] = []


def retain_freed_memory() -> bool:
    """Set the thresholds (once per process); True when ``mallopt`` took both."""
    with _lock:
        if not _done:
            _done.append(_set())
        return _done[0]


def _set() -> bool:
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def retained() -> bool:
    """Whether ``retain_freed_memory()`` ran in this process and took effect."""
    return bool(_done and _done[0])
