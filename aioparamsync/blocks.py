"""New arrays for large values, in memory reused once no one holds it.

A fold of a large tensor writes new arrays (the new value, and a rule's new
state); from ``np.empty`` each is fresh memory, whose pages the kernel zeroes at
the first write, while the arrays it replaces are given back to the kernel just
after; and so is the buffer a large frame is received into. :func:`empty` and
:func:`empty_like` make such an array from a compiled block instead
(``_cblocks.pyx``): when the last view of it is gone, its memory is kept for the
next array of its size, its pages already the process's, and never more of it
than the process's peak held. On the pure path, and for arrays of 32 MiB or less
(which glibc's heap keeps: ``cli/memory.py``), they are numpy's own.
"""

from __future__ import annotations

import sys

import numpy as np

from ._ext import compiled

__all__ = ["empty", "empty_like"]

_cblocks = compiled("_cblocks")
_Block = _cblocks.Block if _cblocks is not None else None
# The bytes over which an array is a block's (on the pure path, none is): checked here
# first, so that the common small array costs no call into the pool.
_OVER = _cblocks.MIN_BYTES if _cblocks is not None else sys.maxsize


def empty(nbytes: int) -> np.ndarray:
    """A new array of ``nbytes`` bytes (``uint8``), not zeroed."""
    if nbytes > _OVER and _Block is not None:
        return np.frombuffer(_Block(nbytes), np.uint8, nbytes)
    return np.empty(nbytes, np.uint8)


def empty_like(a: np.ndarray) -> np.ndarray:
    """A new C-contiguous array of ``a``'s shape and dtype, not zeroed."""
    if a.nbytes > _OVER and _Block is not None:
        return np.frombuffer(_Block(a.nbytes), a.dtype, a.size).reshape(a.shape)
    return np.empty(a.shape, a.dtype)
