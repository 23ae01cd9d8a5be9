"""A large fold cut into parts, folded on several cores at once.

The compiled folds (``_cfold.pyx``) let go of the GIL while they run, and each
element's fold reads and writes that element alone: a fold of n elements is
the folds of its parts, the same bits, in any order. So a fold of a large
tensor (``adam``'s is bound by its square roots and divisions, ~35 ms for 64 MiB
on one core) runs on up to :func:`threads` cores, as torch runs an optimizer's
step on a large tensor (its intra-op threads). The caller folds the first part
itself and waits for the others: to the event loop, a fold is one call still,
only shorter.

Parts are of at least ``PART_BYTES``: under it, handing a part to a thread
costs more than it saves.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["PART_BYTES", "in_parts", "set_threads", "threads"]

# The least bytes (of the largest array a fold writes) a part has.
PART_BYTES = 1 << 20
# Elements a part's bounds are a multiple of (a cache line of float32).
_ALIGN = 16
# The most threads by default: past this the folds wait on memory, not on the cores.
DEFAULT_MOST = 4

_threads = max(1, min(DEFAULT_MOST, os.cpu_count() or 1))
_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def threads() -> int:
    """The most cores one fold runs on (1: the caller's thread alone)."""
    return _threads


def set_threads(n: int) -> int:
    """Fold on at most ``n`` cores (1: in the caller's thread alone); answer the old number.

    Raises:
        ValueError: ``n`` is less than 1.
    """
    global _threads, _pool
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"fold threads must be a whole number of at least 1, not {n!r}")
    with _lock:
        old, _threads = _threads, n
        if _pool is not None and n != old:
            pool, _pool = _pool, None
            pool.shutdown(wait=False)  # (its threads end once their parts are done)
    return old


def _forget_pool() -> None:
    """In a forked child: the parent's threads are not there (a new pool is made)."""
    global _pool, _lock
    _pool, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def in_parts(run: Callable[[slice], object], n: int, itemsize: int) -> list[object]:
    """``run(part)`` for parts of ``range(n)`` that together are all of it; their answers.

    One part (``slice(0, n)``) unless the ``n * itemsize`` bytes are at least
    two ``PART_BYTES`` and more than one thread is allowed. Every part has
    ended when this returns or raises (a part's exception, the first part's first).
    """
    global _pool
    parts = min(_threads, n * itemsize // PART_BYTES)
    if parts <= 1:
        return [run(slice(0, n))]
    step = -(-n // parts)
    step += -step % _ALIGN
    bounds = [slice(start, min(n, start + step)) for start in range(0, n, step)]
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_threads - 1, thread_name_prefix="aioparamsync-fold")
        futures: list[Future[object]] = [_pool.submit(run, part) for part in bounds[1:]]
    try:
        first = run(bounds[0])
    finally:
        for f in futures:
            f.exception()  # (waits for it, whatever the first part did)
    return [first, *(f.result() for f in futures)]
