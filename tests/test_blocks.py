"""Large blocks kept for reuse (``_cblocks.pyx``, through ``aioparamsync.blocks``).

A block's memory is reused only once nothing can read it: no array, view or
memoryview of it (a reply being written, a reader's array) is left. The pool
never holds more than the most blocks held live at once, nor more than its cap.
The pool is the process's: these measure differences, and give back what they
kept.
"""

from __future__ import annotations

import gc
import random

import numpy as np
import pytest

from aioparamsync import adam, blocks, sgd
from aioparamsync.store.table import ParameterTable
from aioparamsync.values import rules
from aioparamsync.values.arrays import to_parameter

cb = blocks._cblocks
pytestmark = pytest.mark.skipif(cb is None, reason="the compiled path is not built")

MiB = 1 << 20
BIG = 36 * MiB  # (over MIN_BYTES: smaller arrays are numpy's own)


def address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


@pytest.fixture(autouse=True)
def _kept_nothing_before_and_after():
    cb.trim()
    yield
    gc.collect()
    cb.trim()


def test_a_block_let_go_is_the_next_block_of_its_size():
    like = np.zeros(BIG // 4, np.float32)
    a = blocks.empty_like(like)
    assert a.shape == like.shape and a.dtype == like.dtype and a.flags.writeable
    where = address(a)
    made = cb.stats()["made"]
    del a
    b = blocks.empty_like(like)
    assert address(b) == where
    assert cb.stats()["made"] == made  # reused, not mapped


@pytest.mark.parametrize(
    "hold",
    [
        lambda a: memoryview(a)[10:20],  # a slice of a reply's view (its own managed buffer)
        lambda a: memoryview(a).cast("B")[5:],
        lambda a: a[3:9],  # a numpy view
        lambda a: np.frombuffer(memoryview(a.reshape(-1)).cast("B"), np.uint8),
        lambda a: a.reshape(2, -1).T,
    ],
)
def test_a_block_anything_still_reads_is_not_reused(hold):
    like = np.zeros(BIG // 4, np.float32)
    a = blocks.empty_like(like)
    a[:] = 7.0
    held = hold(a)
    before = bytes(memoryview(held).cast("B")) if isinstance(held, memoryview) else held.tobytes()
    where = address(a)
    del a
    gc.collect()
    b = blocks.empty_like(like)
    assert address(b) != where
    b[:] = -1.0
    after = bytes(memoryview(held).cast("B")) if isinstance(held, memoryview) else held.tobytes()
    assert after == before
    del held
    c = blocks.empty_like(like)  # now it is
    assert address(c) == where


def test_arrays_of_up_to_32_mib_are_numpys_own():
    made = cb.stats()["made"]
    a = blocks.empty_like(np.zeros(cb.MIN_BYTES // 4, np.float32))
    b = blocks.empty(1000)
    assert cb.stats()["made"] == made and a.base is None and b.base is None
    c = blocks.empty(cb.MIN_BYTES + 1)
    assert cb.stats()["made"] == made + 1 and len(c) == cb.MIN_BYTES + 1


def test_what_is_kept_never_raises_the_peak_and_stays_under_the_cap():
    rng = random.Random(7)
    sizes = [1 * MiB, 2 * MiB, 3 * MiB + 1, 5 * MiB]
    held: list[object] = []
    start = cb.stats()
    peak = start["peak"]
    for _ in range(400):
        if held and rng.random() < 0.5:
            held.pop(rng.randrange(len(held)))
        else:
            held.append(cb.Block(rng.choice(sizes)))
        s = cb.stats()
        assert s["peak"] == max(peak, s["live"])  # raised by what is live alone
        peak = s["peak"]
        assert s["live"] + s["kept"] <= peak
        assert s["kept"] <= cb.DEFAULT_CAP
    assert cb.stats()["reused"] > start["reused"]
    held.clear()
    old = cb.set_cap(3 * MiB)
    try:
        assert cb.stats()["kept"] <= 3 * MiB
        big = cb.Block(8 * MiB)
        del big
        assert cb.stats()["kept"] <= 3 * MiB  # not kept: over the cap
    finally:
        cb.set_cap(old)
    cb.trim()
    assert cb.stats()["kept"] == 0


def test_bad_sizes_and_caps_are_refused():
    with pytest.raises(ValueError, match="block of 0 bytes"):
        cb.Block(0)
    with pytest.raises(ValueError, match="block of -5 bytes"):
        cb.Block(-5)
    with pytest.raises(ValueError, match="cap of -1 bytes"):
        cb.set_cap(-1)
    with pytest.raises(MemoryError, match="no memory for a block"):
        cb.Block(1 << 62)


@pytest.mark.parametrize("rule", [sgd(0.1, momentum=0.9), adam(0.01)], ids=["momentum", "adam"])
def test_large_folds_into_kept_blocks_are_numpys_bits_and_leave_old_values_alone(rule):
    """A table's fold of a 36 MiB parameter, value and state in blocks: the bits of numpy's
    fold, step after step, and a value read before a fold (as a reply being written holds
    it) keeps its bytes through the folds after it."""
    rng = np.random.default_rng(3)
    n = BIG // 4
    w = rng.standard_normal(n).astype(np.float32)
    table = ParameterTable()
    p = to_parameter("w", w)
    p.rule = rule
    table.apply([p], 1)
    want, state = w, None
    reads = []
    for step in range(4):
        g = rng.standard_normal(n).astype(np.float32)
        table.fold([to_parameter("w", g)], step + 2)
        with np.errstate(all="ignore"):
            want, state = rules._fold_numpy(rule, want, g, state or rules.State())
        entry = table.entry("w")
        assert entry is not None
        got = np.frombuffer(entry.data, np.float32)
        assert got.tobytes() == want.tobytes()
        reads.append((got[::4096], want[::4096].copy()))
    for read, value in reads:
        assert read.tobytes() == value.tobytes()
    assert cb.stats()["reused"] > 0
