"""How a node process asks glibc's malloc to keep the memory it frees.

A node receives every large write into a new buffer, and every fold makes new
arrays: with glibc's defaults, a freed block at the top of the heap above
128 KiB goes back to the system, and blocks of a few MiB come from ``mmap``
until its threshold has grown, so the next one is faulted in again, a page at
a time (half of a 64 MiB push's page faults, about a fifth of its time here:
``docs/performance.md``). A node keeps what it frees instead: its peak memory
is bounded by the stored bytes, the receive budget and a frame as it is
(see the README), whether it gives memory back between writes or not.

Only the node's own process does this (``aioparamsync-node``), never a
program that imports the package; elsewhere than glibc, nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["keep_freed_memory"]

# mallopt's parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc takes (HEAP_MAX_SIZE / 2 on 64-bit): blocks up to it
# come from the heap, larger ones (a frame of 64 MiB) from mmap, as they are.
MMAP_THRESHOLD = 32 * 1024 * 1024
# Free memory at the top of the heap kept, not trimmed (its most: what glibc takes).
TRIM_THRESHOLD = (1 << 31) - 1


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse; answer whether it took it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # (not glibc: musl has no mallopt)
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    took = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    return mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and took
