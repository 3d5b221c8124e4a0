"""Give the C heap's free pages back to the system after a large CPU forward.

A prompt forward on the CPU allocates and frees megabytes of activations and decoded
weight strips; glibc keeps most of that freed memory in its heap (its mmap threshold
grows with each large free), so the process would hold 40-60% more than the weights and
cache after one long prompt (bench/NOTES-cpu-exl3.md). ``malloc_trim(0)`` returns the
free pages (top of the heap and, since glibc 2.8, whole free pages inside it); it takes
well under a millisecond next to a prompt forward of hundreds of milliseconds.

Public API:
- ``trim_host_heap() -> bool``: ``malloc_trim(0)`` where the C library has it (glibc);
  False elsewhere (musl, macOS, Windows), where it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache


@cache
def _malloc_trim():  # noqa: ANN202 - a ctypes function or None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def trim_host_heap() -> bool:
    """Return the C heap's free pages to the system; False where there is no malloc_trim."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
