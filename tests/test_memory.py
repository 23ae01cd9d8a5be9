"""A node process keeps the memory it frees (``aioparamsync.cli.memory``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = """
import ctypes, numpy as np
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
from aioparamsync.cli.memory import keep_freed_memory
import sys
if sys.argv[1] == "kept":
    assert keep_freed_memory()
before = libc.mallinfo2().hblkhd
a = np.ones(16 << 20, np.uint8)  # 16 MiB: from mmap by default, from the heap once kept
mapped = libc.mallinfo2().hblkhd - before
del a
b = np.ones(16 << 20, np.uint8)
print(mapped, libc.mallinfo2().arena >= 16 << 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_node_process_takes_large_blocks_from_the_heap_and_keeps_them() -> None:
    def run(mode: str) -> list[str]:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    mapped, in_heap = run("kept")
    assert int(mapped) == 0 and in_heap == "True"  # (kept: from the heap, reused)
    mapped, _ = run("default")
    assert int(mapped) >= 16 << 20  # (glibc's default: a block of its own, mapped)
