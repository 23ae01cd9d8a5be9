"""The compiled folds (``values/_cfold.pyx``) against numpy's, bit for bit.

A float32 or float64 parameter folds a gradient of its dtype by the compiled
loop where it was built (the first CI pass), and by numpy everywhere else (the
pure pass runs ``tests/test_rules.py`` on numpy's). These compare the two on
the same input: every rule and option, every state a step leaves, values from
1e-30 to 1e30 and the special ones, sizes about the loop's chunk, and inputs at
every byte offset (a gradient is read where it arrived in its frame).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from aioparamsync import ErrorCode, RequestError, adam, sgd, sum_rule, thrift
from aioparamsync.store.table import ParameterTable
from aioparamsync.values import parallel, rules
from aioparamsync.values.arrays import to_parameter

pytestmark = pytest.mark.skipif(rules._cfold is None, reason="the compiled path is not built")

RULES = {
    "sum": sum_rule(),
    "sgd": sgd(0.1),
    "sgd-decay": sgd(0.05, weight_decay=1e-3),
    "sgd-tiny-decay": sgd(1e-3, weight_decay=1e-50),  # 0 in float32, yet numpy decays by it
    "momentum": sgd(0.037, momentum=0.9),
    "momentum-decay": sgd(0.3, momentum=0.5, weight_decay=0.01),
    "adam": adam(),
    "adam-decay": adam(0.01, betas=(0.5, 0.77), eps=1e-6, weight_decay=0.1),
}
SIZES = [0, 1, 7, 1023, 1024, 1025, 3000]  # (about the chunk an unaligned input is read in)


def wild(rng: np.random.Generator, n: int, dtype: type) -> np.ndarray:
    """Values of every magnitude, with some NaN, inf and signed zeros."""
    a = (rng.standard_normal(n) * 10 ** rng.uniform(-30, 30, n)).astype(dtype)
    if n > 4:
        a[rng.integers(0, n, 4)] = [np.inf, -np.inf, np.nan, -0.0]
    return a


def at_offset(a: np.ndarray, offset: int) -> np.ndarray:
    """A read-only copy of ``a`` starting ``offset`` bytes into its buffer (unaligned)."""
    view = np.frombuffer(b"\0" * offset + a.tobytes(), a.dtype, a.size, offset)
    assert offset == 0 or a.size == 0 or not view.flags.aligned
    return view


def same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """The same bits, but for a NaN's payload (which NaN an operation passes on is the
    hardware's choice, and numpy's loops order operands their own way)."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b))) and a[~nan].tobytes() == b[~nan].tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(RULES))
def test_a_compiled_fold_is_numpys_bit_for_bit(name: str, dtype: type) -> None:
    rule = RULES[name]
    rng = np.random.default_rng(sum(map(ord, name)) + dtype().itemsize)
    for n in SIZES:
        for offset in range(dtype().itemsize):
            w = wild(rng, n, dtype)
            mine = theirs = None
            for _ in range(3):  # (each step from the state the one before left)
                g = wild(rng, n, dtype)
                with np.errstate(all="ignore"):
                    expected, theirs = rules._fold_numpy(rule, w, g, theirs or rules.State())
                    got, mine = rules.fold_into(
                        rule, at_offset(w, offset), at_offset(g, offset), mine
                    )
                where = f"{name} {dtype.__name__} n={n} offset={offset}"
                assert same(got, expected), where
                assert mine.step == theirs.step, where
                assert same(mine.momentum, theirs.momentum), where
                assert same(mine.variance, theirs.variance), where
                w = expected


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_compiled_check_finds_every_nan_and_inf(dtype: type) -> None:
    for n in (1, 1023, 1024, 1025, 5000):
        for offset in range(0, dtype().itemsize, 3):
            clean = np.full(n, 1.5, dtype)
            assert rules._cfold.all_finite(at_offset(clean, offset))
            for bad in (np.nan, np.inf, -np.inf):
                for position in (0, n // 2, n - 1):
                    a = clean.copy()
                    a[position] = bad
                    assert not rules._cfold.all_finite(at_offset(a, offset)), (n, position)
    assert rules._cfold.all_finite(np.zeros(0, dtype))


def test_a_push_with_nan_at_an_odd_offset_is_refused_and_changes_nothing() -> None:
    table = ParameterTable()
    w = to_parameter("w", np.zeros(3000, np.float32))
    w.rule = sgd(0.1)
    table.apply([w], 1)
    grad = np.ones(3000, np.float32)
    grad[2999] = np.nan
    g = to_parameter("w", grad)
    g.data = at_offset(grad, 1).view(np.uint8)  # as it lies in a frame
    with pytest.raises(RequestError, match="holds 1 of 3000 values that are not finite") as caught:
        table.fold([g], 2)
    assert caught.value.code == ErrorCode.BAD_REQUEST
    entry = table.entry("w")
    assert entry is not None and entry.version == 1
    assert not np.frombuffer(entry.data, np.float32).any()


def test_a_compiled_fold_refuses_arrays_it_cannot_fold() -> None:
    c = rules._cfold
    w, g = np.ones(8, np.float32), np.ones(8, np.float32)
    out = np.empty(8, np.float32)
    with pytest.raises(TypeError, match="float32 or float64, not 'i'"):
        c.add(np.ones(8, np.int32), g, out)
    with pytest.raises(TypeError, match="of one dtype and length"):
        c.add(w, np.ones(8, np.float64), out)
    with pytest.raises(TypeError, match="of one dtype and length"):
        c.add(w, np.ones(9, np.float32), out)
    with pytest.raises(ValueError, match="not C-contiguous"):
        c.add(np.ones(16, np.float32)[::2], g, out)
    with pytest.raises(ValueError, match="not C-contiguous"):
        c.add(np.ones((4, 4), np.float32).T[:2], np.ones((2, 4), np.float32), out)
    frozen = np.empty(8, np.float32)
    frozen.flags.writeable = False
    with pytest.raises((ValueError, BufferError), match=r"read-only|not writable"):
        c.add(w, g, frozen)
    with pytest.raises(ValueError, match="aligned"):
        c.add(w, g, np.frombuffer(bytearray(33), np.float32, 8, 1))
    with pytest.raises(ValueError, match="both moments"):
        c.adam(w, g, out, np.empty(8, np.float32), np.empty(8, np.float32), w, None,
               -0.1, 0.0, 0.9, 0.999, 1.0, 1e-8)  # fmt: skip
    with pytest.raises(ValueError, match="needs a buffer"):
        c.sgd(w, g, out, None, w, -0.1, 0.0, 0.9)


def test_other_dtypes_and_layouts_fold_with_numpy() -> None:
    # A float16 parameter is computed in float32, a gradient of another dtype is converted,
    # and a strided array is read as it is: numpy's path, the same as before.
    for w, g in (
        (np.ones(5, np.float16), np.ones(5, np.float16)),
        (np.ones(5, np.float32), np.ones(5, np.float16)),
        (np.ones(10, np.float32)[::2], np.ones(5, np.float32)),
        (np.ones((3, 3), np.float64).T, np.ones((3, 3), np.float64)),
    ):
        got, _ = rules.fold(sgd(0.5), w, g, None)
        assert got.dtype == w.dtype
        np.testing.assert_array_equal(got, np.full(w.shape, 0.5, w.dtype))


# -- a large fold in parts, on several cores (values/parallel.py) ---------------------------


@pytest.fixture
def fold_threads():
    """Set the process's fold threads for a test; the old number back after it."""
    old = parallel.threads()
    yield parallel.set_threads
    parallel.set_threads(old)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["sum", "sgd-decay", "momentum-decay", "adam-decay"])
def test_a_large_fold_in_parts_is_the_bits_of_one_pass_and_of_numpy(fold_threads, name, dtype):
    rule = RULES[name]
    rng = np.random.default_rng(11)
    n = (5 * parallel.PART_BYTES) // np.dtype(dtype).itemsize + 7  # (parts of unequal size)
    w = wild(rng, n, dtype)
    if dtype is np.float32:
        w = w.reshape(-1, 1)  # (parts of the flat array: any shape)
    answers = {}
    for threads in (1, 4):
        fold_threads(threads)
        state, value = None, w
        for _ in range(3):
            g = at_offset(wild(np.random.default_rng(5), n, dtype), 1)
            value, state = rules.fold(rule, value, g.reshape(w.shape), state)
        answers[threads] = (value, state)
    (one, s1), (parts, s4) = answers[1], answers[4]
    assert one.tobytes() == parts.tobytes()
    assert same(s1.momentum, s4.momentum) and same(s1.variance, s4.variance)
    state, value = rules.State(), w
    with np.errstate(all="ignore"):
        for _ in range(3):
            g = at_offset(wild(np.random.default_rng(5), n, dtype), 1)
            value, state = rules._fold_numpy(rule, value, g.reshape(w.shape), state)
    assert same(value, parts)


def test_a_large_finite_check_in_parts_finds_the_one_bad_value(fold_threads):
    fold_threads(4)
    n = 4 * parallel.PART_BYTES // 4 + 3
    for where in (0, n // 2, n - 1):
        a = np.ones(n, np.float32)
        assert rules.all_finite(a)
        a[where] = np.nan
        assert not rules.all_finite(a)


def test_parts_cover_the_range_once_and_all_end_before_a_failure_is_raised(fold_threads):
    fold_threads(4)
    n = 10 * parallel.PART_BYTES + 5
    seen = np.zeros(n, np.int8)
    ended = []

    def run(part: slice) -> int:
        seen[part] += 1
        ended.append(part.start)
        return part.stop - part.start

    sizes = parallel.in_parts(run, n, 1)
    assert len(sizes) == 4 and sum(sizes) == n and (seen == 1).all()
    assert all(start % 16 == 0 for start in ended)  # (parts start on a cache line)

    ended.clear()

    def failing(part: slice) -> None:
        if not part.start:
            raise RuntimeError("the caller's part failed")
        time.sleep(0.05)
        ended.append(part.start)

    with pytest.raises(RuntimeError, match="the caller's part failed"):
        parallel.in_parts(failing, n, 1)
    assert len(ended) == 3  # (every other part had ended: none writes after the raise)

    def last_fails(part: slice) -> None:
        if part.stop == n:
            raise RuntimeError("the last part failed")

    with pytest.raises(RuntimeError, match="the last part failed"):
        parallel.in_parts(last_fails, n, 1)
    assert parallel.in_parts(lambda p: (p.start, p.stop), parallel.PART_BYTES * 2 - 1, 1) == [
        (0, parallel.PART_BYTES * 2 - 1)
    ]  # (under two parts' bytes: one)
    fold_threads(1)
    assert parallel.in_parts(lambda p: (p.start, p.stop), n, 1) == [(0, n)]


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2", None])
def test_fold_threads_must_be_a_whole_number_of_at_least_one(fold_threads, bad):
    with pytest.raises(ValueError, match="fold threads must be a whole number of at least 1"):
        fold_threads(bad)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_folds_in_parts_with_threads_of_its_own(fold_threads):
    fold_threads(2)
    n = 4 * parallel.PART_BYTES
    parallel.in_parts(lambda p: None, n, 1)  # (the parent's pool has threads now)
    pid = os.fork()
    if pid == 0:  # the child: its pool's threads were not forked with it
        done = threading.Event()

        def fold() -> None:
            parallel.in_parts(lambda p: None, n, 1)
            done.set()

        threading.Thread(target=fold, daemon=True).start()
        os._exit(0 if done.wait(20) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _checked_fold(name: str, w: np.ndarray, g: np.ndarray, out: np.ndarray, check: bool) -> bool:
    """The compiled fold ``name`` of ``g`` into ``w`` (to ``out``), asked to check or not."""
    c = rules._cfold
    if name == "add":
        return c.add(w, g, out, check)
    if name == "sgd":
        return c.sgd(w, g, out, None, None, -0.1, 0.0, 0.0, check)
    if name == "momentum":
        return c.sgd(w, g, out, np.empty_like(w), w, -0.1, 0.01, 0.9, check)
    m, v = np.empty_like(w), np.empty_like(w)
    return c.adam(w, g, out, m, v, None, None, -0.1, 0.0, 0.9, 0.999, 0.1, 1e-8, check)


@pytest.mark.parametrize("name", ["add", "sgd", "momentum", "adam"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_each_compiled_fold_checks_its_gradient_in_the_same_call_when_asked(name, dtype):
    for n in (1, 1023, 1025, 5000):
        w = np.linspace(-1, 1, n).astype(dtype)
        for offset in (0, 1):
            clean = np.full(n, 0.25, dtype)
            checked, unchecked = np.empty_like(w), np.empty_like(w)
            assert _checked_fold(name, w, at_offset(clean, offset), checked, True) is True
            assert _checked_fold(name, w, at_offset(clean, offset), unchecked, False) is True
            assert same(checked, unchecked)
            for bad in (np.nan, np.inf, -np.inf):
                for where in {0, n // 2, n - 1}:
                    g = clean.copy()
                    g[where] = bad
                    assert _checked_fold(name, w, at_offset(g, offset), checked, True) is False
                    # (not asked: folded, and said to be fine)
                    assert _checked_fold(name, w, at_offset(g, offset), checked, False) is True


def test_a_large_push_with_one_bad_value_in_any_part_is_refused_whole(fold_threads):
    fold_threads(4)
    n = 4 * parallel.PART_BYTES // 4 + 3  # (four parts)
    table = ParameterTable()
    w = to_parameter("w", np.zeros(n, np.float32))
    w.rule = sgd(0.1, momentum=0.9)
    table.apply([w], 1)
    for where in (0, n // 4 + 1, n // 2, n - 1):
        grad = np.ones(n, np.float32)
        grad[where] = np.inf
        with pytest.raises(RequestError, match=f"holds 1 of {n} values that are not finite"):
            table.fold([to_parameter("w", grad)], 2)
        entry = table.entry("w")
        assert entry is not None and entry.version == 1 and table.state("w") is None
    table.fold([to_parameter("w", np.ones(n, np.float32))], 3)
    entry = table.entry("w")
    assert entry is not None and entry.version == 2
    assert np.all(np.frombuffer(entry.data, np.float32) == np.float32(-0.1))


# -- a push's fold compiled whole (rules.fold_entries, ParameterTable.fold's common case) --


def lane(table: ParameterTable, grads: list) -> tuple[dict, dict, list]:
    """What the compiled lane makes of ``grads`` against ``table`` (nothing is stored)."""
    made = rules.fold_entries(
        grads,
        table._entries,
        table._states,
        table.origin,
        entry=type(table.entry(next(iter(table.names())))),
        max_version=2**31 - 1,
        max_name_bytes=table.limits.max_name_bytes,
    )
    assert made is not None
    return made


def stored(table: ParameterTable, rules_by_name: dict, arrays: dict) -> None:
    params = []
    for name, array in arrays.items():
        p = to_parameter(name, array)
        p.rule = rules_by_name[name]
        params.append(p)
    table.apply(params, 1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1025,), (5, 7), ()])
def test_a_push_compiled_whole_is_numpys_bit_for_bit_from_every_state(
    dtype: type, shape: tuple
) -> None:
    # Every rule in one push, each tensor by its own, over three steps (each from the state
    # the one before left), gradients as raw bytes at every offset a frame may hold them.
    # (wild values hold NaN and inf: rules that fold them, as the numpy path is asked to)
    allowing = {k: thrift.Rule(**{**r.__dict__, "allow_nonfinite": True}) for k, r in RULES.items()}
    rng = np.random.default_rng(7 + dtype().itemsize + len(shape))
    names = sorted(RULES)
    n = int(np.prod(shape))
    ws = {name: wild(rng, n, dtype).reshape(shape) for name in names}
    table = ParameterTable("n")
    stored(table, allowing, ws)
    theirs = dict.fromkeys(names, rules.State())
    for step in range(3):
        gs = {name: wild(rng, n, dtype).reshape(shape) for name in names}
        grads = []
        for i, name in enumerate(names):
            g = to_parameter(name, gs[name])
            g.data = at_offset(gs[name].reshape(-1), (i + step) % dtype().itemsize).view(np.uint8)
            grads.append(g)
        made, _, rest = lane(table, grads)
        assert rest == [] and list(made) == names
        applied = table.fold(grads, 2 + step)
        assert [e.name for e in applied.entries] == names
        for name in names:
            with np.errstate(all="ignore"):
                expected, theirs[name] = rules._fold_numpy(
                    RULES[name], ws[name], gs[name], theirs[name]
                )
            entry, mine = table.entry(name), table.state(name)
            where = f"{name} {dtype.__name__} {shape} step {step}"
            assert entry.version == 2 + step and entry.array is None, where
            assert entry.data.readonly and entry.data.nbytes == expected.nbytes, where
            assert same(np.frombuffer(entry.data, dtype).reshape(shape), expected), where
            assert same(np.frombuffer(made[name].data, dtype).reshape(shape), expected), where
            assert mine.step == theirs[name].step == step + 1, where
            assert same(mine.momentum, theirs[name].momentum), where
            assert same(mine.variance, theirs[name].variance), where
            ws[name] = expected


def test_a_push_compiled_whole_refuses_nan_or_inf_by_name_and_changes_nothing():
    for bad in (np.nan, np.inf, -np.inf):
        table = ParameterTable("n")
        stored(table, {"a": sgd(0.1), "b": sgd(0.1), "c": sgd(0.1, allow_nonfinite=True)},
               {n: np.zeros(16, np.float32) for n in "abc"})  # fmt: skip
        g = np.ones(16, np.float32)
        g[15] = bad
        grads = [to_parameter("a", np.ones(16, np.float32)), to_parameter("b", g)]
        assert lane(table, grads)[2] == [1]  # (left to the caller's check)
        with pytest.raises(RequestError, match="gradient 'b' holds 1 of 16") as caught:
            table.fold(grads, 2)
        assert caught.value.code == ErrorCode.BAD_REQUEST
        assert [table.entry(n).version for n in "abc"] == [1, 1, 1]
        table.fold([grads[0], to_parameter("c", g)], 3)
        assert (np.frombuffer(table.entry("a").data, np.float32) == np.float32(-0.1)).all()
        assert same(np.frombuffer(table.entry("c").data, np.float32), g * np.float32(-0.1))


def test_a_push_compiled_whole_leaves_every_other_case_to_the_checks_that_name_it():
    # Each odd gradient beside a plain one: the lane takes the plain one and leaves the
    # other (rest), and the push is refused as the pure path refuses it, or folded by
    # numpy's path where it may be, the plain one by the lane.
    from aioparamsync.store.table import Limits

    def table_of() -> ParameterTable:
        table = ParameterTable("n", Limits(max_name_bytes=40))
        stored(
            table,
            {"w": sgd(0.1), "x": sgd(0.1), "big": sgd(0.1), "ints": sum_rule(), "m": sgd(0.1)},
            {
                "w": np.zeros(8, np.float32),
                "x": np.zeros((2, 4), np.float32),
                "big": np.zeros(rules._SPLIT_BYTES // 4, np.float32),
                "ints": np.zeros(8, np.int32),
                "m": np.zeros(8, np.float32),
            },
        )
        table.apply([to_parameter("norule", np.zeros(8, np.float32))], 1)
        return table

    plain = to_parameter("w", np.ones(8, np.float32))

    def odd(name: str, array: np.ndarray, **fields: object) -> object:
        g = to_parameter(name, array)
        for k, v in fields.items():
            setattr(g, k, v)
        return g

    ones = np.ones(8, np.float32)
    refused = {
        "unknown": (odd("nothere", ones), "no parameter 'nothere'"),
        "twice": (odd("w", ones), "appears twice"),
        "no rule": (odd("norule", ones), "has no rule"),
        "encoded": (odd("x", ones.reshape(2, 4), encoding="zlib"), "has no raw data"),
        "no data": (odd("x", ones.reshape(2, 4), data=None), "has no raw data"),
        "no dtype": (odd("x", ones.reshape(2, 4), dtype=None), "has no dtype"),
        "shape": (odd("x", ones), "has shape"),
        "bytes": (odd("x", ones.reshape(2, 4), data=b"\0" * 31), "SHAPE_MISMATCH|bytes|elements"),
        "wider": (odd("x", ones.reshape(2, 4).astype(np.float64)), "float64"),
    }
    for case, (g, message) in refused.items():
        table = table_of()
        assert lane(table, [plain, g])[2] == [1], case
        with pytest.raises(RequestError, match=message):
            table.fold([plain, g], 2)
        assert table.entry("w").version == 1 and table.entry("x").version == 1, case
    folded = {
        "narrower": odd("x", ones.reshape(2, 4).astype(np.float16)),
        "big-endian": odd("x", ones.reshape(2, 4).astype(">f4")),
        "large": odd("big", np.ones(rules._SPLIT_BYTES // 4, np.float32)),
        "ints": odd("ints", np.ones(8, np.int32)),
    }
    for case, g in folded.items():
        table = table_of()
        assert lane(table, [plain, g])[2] == [1], case
        applied = table.fold([plain, g], 2)
        assert [e.name for e in applied.entries] == ["w", g.name], case
        assert table.entry("w").array is None  # (the plain one: the lane's)
        got = np.frombuffer(table.entry(g.name).data, table.entry(g.name).dtype)
        assert (got == (-0.1 * np.ones_like(got) if g.name != "ints" else 1)).all(), case
    # A name longer than the limit (a stored one, of a larger limit before): refused.
    table = table_of()
    long = "n" * 41
    m = table.entry("m")
    fields = (m.data, m.version, m.dtype, m.shape, m.origin, m.rule)
    table._entries[long] = type(m)(long, *fields)
    assert lane(table, [plain, odd(long, ones)])[2] == [1]
    with pytest.raises(RequestError, match="longer than 40"):
        table.fold([plain, odd(long, ones)], 2)


def test_a_push_folds_small_large_and_converted_gradients_as_one_pass_of_each_would():
    # One push: small float32 and float64 tensors (the lane), a large one (in parts), a
    # float16 gradient of a float32 parameter and a float16 parameter (numpy's path); then
    # the small ones by numpy's path, from the lane's state, and back.
    rng = np.random.default_rng(3)
    large = rules._SPLIT_BYTES // 4 + 5
    shapes = {
        "small32": (np.float32, np.float32, (4, 8)),
        "small64": (np.float64, np.float64, (33,)),
        "large": (np.float32, np.float32, (large,)),
        "converted": (np.float32, np.float16, (9,)),
        "half": (np.float16, np.float16, (9,)),
    }
    table = ParameterTable()
    stored(
        table,
        {n: [adam(0.01), sgd(0.1, momentum=0.9), sgd(0.2)][i % 3] for i, n in enumerate(shapes)},
        {n: rng.standard_normal(s).astype(d) for n, (d, _, s) in shapes.items()},
    )
    for step in range(4):
        kinds = {n: g if step != 2 or d is g is np.float64 else np.float16
                 for n, (d, g, _) in shapes.items()}  # fmt: skip
        grads = {n: rng.standard_normal(s).astype(kinds[n]) for n, (_, _, s) in shapes.items()}
        before = {n: np.frombuffer(table.entry(n).data, d).reshape(s).copy()
                  for n, (d, _, s) in shapes.items()}  # fmt: skip
        states = {n: table.state(n) for n in shapes}
        push = [to_parameter(n, g) for n, g in grads.items()]
        quick = {g.name for g in push} - {push[i].name for i in lane(table, push)[2]}
        assert quick == ({"small32", "small64"} if step != 2 else {"small64"})
        table.fold(push, 2 + step)
        for name, (dtype, _, shape) in shapes.items():
            entry = table.entry(name)
            expected, state = rules.fold(entry.rule, before[name], grads[name], states[name])
            assert entry.version == 2 + step, name
            assert same(np.frombuffer(entry.data, dtype).reshape(shape), expected), name
            assert table.state(name).step == state.step == step + 1, name
            assert same(table.state(name).momentum, state.momentum), name
            assert same(table.state(name).variance, state.variance), name
