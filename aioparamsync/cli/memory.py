"""How a node process asks glibc's malloc to keep the memory it frees, and Python's
collector to skip what lives as long as the process.

A node receives every large write into a new buffer, and every fold makes new
arrays: with glibc's defaults, a freed block at the top of the heap above
128 KiB goes back to the system, and blocks of a few MiB come from ``mmap``
until its threshold has grown, so the next one is faulted in again, a page at
a time (half of a 64 MiB push's page faults, about a fifth of its time here:
``docs/performance.md``). A node keeps what it frees instead: its peak memory
is bounded by the stored bytes, the receive budget and a frame as it is
(see the README), whether it gives memory back between writes or not.

A push of many small tensors makes and drops a few objects per tensor (its
parameters, their new arrays and entries): Python's cyclic collector ran its
youngest generation every 700 of them and the whole heap (some 35,000 objects of
modules and classes, before a parameter is stored) every 150 steps or so,
14 ms each time: about 6% of a node's time under steps of 200 x 4 KiB (a pull, a push).
:func:`collect_less` freezes what the process made before it serves (it lives
as long as the process: the collector skips it), and collects the youngest
generation every 2000 (Python 3.13's default): under the same load, the
collections took about 1% of that time. Objects are still freed as their last
reference goes; only garbage in reference cycles waits a little longer.

Only the node's own process does this (``aioparamsync-node``), never a
program that imports the package; elsewhere than glibc, nothing is done to malloc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys

__all__ = ["collect_less", "keep_freed_memory"]

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


# The collector's youngest generation is collected once this many more objects it
# tracks were made than freed (Python 3.11's default: 700; 3.13's: 2000).
YOUNGEST_THRESHOLD = 2000


def collect_less() -> None:
    """Freeze what the process holds now, and collect the youngest generation less often.

    Call it once, when everything the process keeps for its lifetime is made and before
    it serves: what is frozen is never collected (garbage first collected, so none is)."""
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNGEST_THRESHOLD, middle, oldest)
