"""Sparse embedding rows: the index against a dict, initializers, rules against numpy and torch."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioparamsync import adagrad as adagrad_rule
from aioparamsync import adam as adam_rule
from aioparamsync import placement
from aioparamsync import sgd as sgd_rule
from aioparamsync.errors import ErrorCode, RequestError
from aioparamsync.values import rowcopy, rowindex
from aioparamsync.values import rows as rows_module
from aioparamsync.values.arrays import parse_dtype
from aioparamsync.values.rowcopy import put_rows, take_rows
from aioparamsync.values.rowindex import RowIndex
from aioparamsync.values.rows import (
    BlockSpec,
    Init,
    RowBlock,
    RowRule,
    normal,
    sum_duplicates,
    uniform,
    zeros,
)


# Row rules as tables take them: the one set of constructors (aioparamsync.sgd, ...), as rows.
def sgd(*args, **kwargs) -> RowRule:
    return RowRule.of(sgd_rule(*args, **kwargs))


def adagrad(*args, **kwargs) -> RowRule:
    return RowRule.of(adagrad_rule(*args, **kwargs))


def adam(*args, **kwargs) -> RowRule:
    return RowRule.of(adam_rule(*args, **kwargs))


I64 = np.iinfo(np.int64)
# Ids a hash table is most likely to get wrong: the extremes, and the index's own sentinels.
EDGE_IDS = [I64.min, I64.max, I64.min + 1, I64.max - 1, -1, -2, 0, 1]


def arr(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def distinct_ids(seed: int, n: int) -> np.ndarray:
    """``n`` distinct random int64 ids, in random order."""
    ids = np.random.default_rng(seed).integers(I64.min, I64.max, n, dtype=np.int64)
    _, first = np.unique(ids, return_index=True)
    return ids[np.sort(first)]


# -- the index, against a dict --------------------------------------------------------------


class Model:
    """A dict id -> slot, following the index's documented slot rules."""

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}

    def insert(self, index: RowIndex, ids: np.ndarray) -> None:
        answered = index.insert(ids)
        for i in ids.tolist():
            self.slots.setdefault(i, len(self.slots))  # new ids: next slot, first appearance
        assert answered.tolist() == [self.slots[i] for i in ids.tolist()]

    def remove(self, index: RowIndex, ids: np.ndarray) -> None:
        moved_from, moved_to = index.remove(ids)
        for i in set(ids.tolist()):
            self.slots.pop(i, None)
        n = len(self.slots)
        assert (moved_from >= n).all() and (moved_to < n).all()
        by_slot = {s: i for i, s in self.slots.items()}
        for f, t in zip(moved_from.tolist(), moved_to.tolist(), strict=True):
            self.slots[by_slot[f]] = t

    def check(self, index: RowIndex, gone: set[int]) -> None:
        assert len(index) == len(self.slots)
        ids = arr(list(self.slots))
        assert index.lookup(ids).tolist() == list(self.slots.values())
        assert sorted(self.slots.values()) == list(range(len(self.slots)))
        assert index.ids(index.slots()).tolist() == index.ids().tolist()
        assert sorted(index.ids().tolist()) == sorted(self.slots)
        absent = arr(sorted(gone - set(self.slots)))
        assert (index.lookup(absent) == -1).all()
        # (the compiled walk, where built, answers as the numpy one: both checked here)
        everything = np.concatenate([ids, absent])
        assert index.lookup(everything).tolist() == index.pure_lookup(everything).tolist()


ids_strategy = st.lists(
    st.one_of(
        st.sampled_from(EDGE_IDS),
        st.integers(-40, 40),
        st.integers(I64.min, I64.max),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), ids_strategy), max_size=25))
def test_index_follows_a_dict(ops) -> None:
    index, model, seen = RowIndex(), Model(), set()
    for is_insert, values in ops:
        ids = arr(values)
        seen.update(values)
        if is_insert:
            model.insert(index, ids)
        else:
            model.remove(index, np.concatenate([ids, arr(list(model.slots)[::3])]))
        model.check(index, seen)


def test_index_large_random_interleaved() -> None:
    rng = np.random.default_rng(1)
    index, model, seen = RowIndex(), Model(), set()
    for step in range(30):
        ids = np.concatenate(
            [
                rng.integers(I64.min, I64.max, 2000, dtype=np.int64),
                rng.integers(-500, 500, 1000),  # repeats, within and across batches
                arr(EDGE_IDS),
            ]
        ).astype(np.int64)
        seen.update(ids.tolist())
        model.insert(index, ids)
        if step % 3 == 2:
            live = arr(list(model.slots))
            model.remove(index, rng.choice(live, len(live) // 2, replace=False))
        model.check(index, seen)


def test_index_growth_keeps_every_mapping() -> None:
    index = RowIndex()
    ids = distinct_ids(2, 20_000)
    buckets = [index.buckets]
    for start in range(0, len(ids), 700):
        index.insert(ids[start : start + 700])
        buckets.append(index.buckets)
        assert (index.lookup(ids[: start + 700]) == np.arange(min(start + 700, len(ids)))).all()
    grown = sorted(set(buckets[1:]))
    assert all(b == 2 * a for a, b in itertools.pairwise(grown))  # doubling
    assert len(index) <= rowindex.MAX_LOAD * index.buckets


def test_index_survives_a_hash_that_collides_everything(monkeypatch) -> None:
    # Every id in one bucket: long probe chains, and every new id wants the same free
    # bucket in the same round.
    monkeypatch.setattr(rowindex, "mix64", lambda x: np.zeros_like(x))
    rng = np.random.default_rng(3)
    index, model, seen = RowIndex(), Model(), set()
    for _ in range(6):
        ids = np.concatenate([arr(EDGE_IDS), rng.integers(-(10**6), 10**6, 80)]).astype(np.int64)
        seen.update(ids.tolist())
        model.insert(index, ids)
        model.remove(index, rng.choice(arr(list(model.slots)), 30, replace=False))
        model.check(index, seen)


def test_index_tombstones_are_rebuilt_away() -> None:
    index = RowIndex()
    ids = np.arange(4096, dtype=np.int64)
    index.insert(ids)
    big = index.buckets
    index.remove(ids[:4000])
    assert index.buckets < big  # tombstones outnumbered the live ids: rebuilt, smaller
    for k in range(50):  # remove one, insert one, near the load limit: no leak of tombstones
        index.remove(arr([10**6 + k - 1]))
        index.insert(arr([10**6 + k]))
    assert len(index) == 97
    assert (index.lookup(ids[4000:]) >= 0).all()
    assert "97 ids" in repr(index)


def test_index_empty_and_nbytes() -> None:
    index = RowIndex()
    assert len(index) == 0 and index.lookup(arr([])).shape == (0,)
    assert index.insert(arr([])).shape == (0,) and index.remove(arr([5]))[0].size == 0
    index.insert(np.arange(10_000, dtype=np.int64))
    # 8 bytes a bucket (at most 6 buckets an id after growth) + 8 an id (+ spare slots).
    assert index.nbytes <= 10_000 * (8 * 6 + 8 * 1.5)


# -- initializers -----------------------------------------------------------------------------


def test_initial_rows_depend_on_table_id_and_seed_only() -> None:
    ids = arr([7, I64.min, -3, I64.max, 10**15, 0])
    init = normal(0.5, seed=9)
    rows = init.values("emb", ids, 17)
    assert rows.dtype == np.float32 and rows.shape == (6, 17)
    order = np.random.default_rng(0).permutation(6)
    assert np.array_equal(init.values("emb", ids[order], 17), rows[order])
    one = RowBlock(BlockSpec("emb", 17, init=init))
    one.pull(arr([1, 2, 3]))  # other rows, made first, change nothing
    assert np.array_equal(one.pull(ids[::-1]), rows[::-1])
    assert not np.array_equal(init.values("other", ids, 17), rows)
    assert not np.array_equal(normal(0.5, seed=10).values("emb", ids, 17), rows)
    assert np.array_equal(Init.from_dict(init.to_dict()).values("emb", ids, 17), rows)
    assert not (zeros().values("emb", ids, 17)).any()


@pytest.mark.parametrize(("init", "std"), [(uniform(0.5), 0.5 / 3**0.5), (normal(0.02), 0.02)])
def test_initial_rows_have_their_distribution(init, std) -> None:
    values = init.values("emb", np.arange(1563, dtype=np.int64), 64).astype(np.float64)
    assert values.size >= 10**5
    assert abs(values.mean()) < 4 * std / values.size**0.5
    assert abs(values.std() / std - 1) < 0.01
    if init.kind == "uniform":
        assert values.min() >= -0.5 and values.max() < 0.5 and abs(values.max() - 0.5) < 1e-3
    else:
        z = values.ravel() / std
        assert abs((z**4).mean() - 3) < 0.1  # a normal's kurtosis
        assert abs(np.corrcoef(values[:, :32].ravel(), values[:, 32:].ravel())[0, 1]) < 0.01
        assert abs((np.abs(z) < 1).mean() - 0.6827) < 0.01


@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16"])
def test_other_dtypes_store_rows(dtype) -> None:
    spec = BlockSpec("emb", 8, dtype, init=uniform(0.1), rule=adam(0.01))
    block = RowBlock(spec)
    ids = arr([3, 4, 3])
    before = block.pull(ids)
    assert before.dtype == spec.np_dtype
    block.fold(ids, np.ones((3, 8), spec.np_dtype), now=1.0)
    after = block.pull(ids).astype(np.float64)
    assert (after < before.astype(np.float64)).all()  # adam moves by ~lr, against the gradient
    assert block.export()["exp_avg"].dtype == spec.work_dtype


# -- rules and specs --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"lr": 0.0}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"lr": float("inf")}, "lr"),
        ({"lr": "0.1"}, "lr"),
        ({"eps": 0.0}, "eps"),
        ({"beta1": 1.0}, "beta1"),
        ({"beta2": -0.1}, "beta2"),
        ({"initial_accumulator": -1.0}, "initial_accumulator"),
        ({"kind": "rmsprop"}, "kind"),
    ],
)
def test_bad_rules_say_which_field(fields, named) -> None:
    with pytest.raises(RequestError) as caught:
        RowRule(**{"kind": "adam", **fields})
    assert caught.value.code == ErrorCode.BAD_REQUEST and named in caught.value.message


def test_specs_round_trip_and_refuse_garbage() -> None:
    spec = BlockSpec("emb", 16, "bfloat16", uniform(0.1, seed=3), adagrad(0.5, eps=1e-6))
    assert BlockSpec.from_dict(spec.to_dict()) == spec
    assert RowRule.from_dict(adam(0.1, betas=(0.5, 0.6)).to_dict()) == adam(0.1, betas=(0.5, 0.6))
    for bad in (
        {**spec.to_dict(), "dim": 0},
        {**spec.to_dict(), "dtype": "int8"},
        {**spec.to_dict(), "color": "red"},
        {**spec.to_dict(), "init": {"kind": "normal", "scale": -1.0}},
        {**spec.to_dict(), "init": {"kind": "normal", "seed": -1}},
    ):
        with pytest.raises(RequestError):
            BlockSpec.from_dict(bad)


def test_duplicates_are_summed_before_one_fold() -> None:
    rng = np.random.default_rng(4)
    g1, g2 = rng.standard_normal((2, 6)).astype(np.float32)
    for rule in (sgd(0.1), adagrad(0.1), adam(0.1)):
        twice, once = (RowBlock(BlockSpec("emb", 6, init=normal(1.0), rule=rule)) for _ in "ab")
        changed = twice.fold(arr([5, 9, 5]), np.stack([g1, g2, g2]), now=1.0)
        once.fold(arr([5, 9]), np.stack([g1 + g2, g2]), now=1.0)
        assert sorted(changed.tolist()) == [5, 9]
        np.testing.assert_allclose(twice.pull(arr([5, 9])), once.pull(arr([5, 9])), rtol=1e-6)
        if rule.kind == "adam":
            assert twice.export()["step"].tolist() == [1, 1]


def test_sum_duplicates_matches_a_loop() -> None:
    rng = np.random.default_rng(5)
    ids = rng.zipf(1.5, 3000).astype(np.int64)
    grads = rng.standard_normal((3000, 5)).astype(np.float32)
    uniq, sums = sum_duplicates(ids, grads)
    expected = {i: np.zeros(5) for i in uniq.tolist()}
    for i, g in zip(ids.tolist(), grads, strict=True):
        expected[i] += g
    np.testing.assert_allclose(sums, np.stack([expected[i] for i in uniq.tolist()]), atol=1e-5)
    same_ids, same = sum_duplicates(arr([3, 1]), grads[:2])
    assert same_ids.tolist() == [3, 1] and np.array_equal(same, grads[:2])


@pytest.mark.skipif(rowcopy._crows is None, reason="the compiled path is not built")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("n", "dim"), [(100_000, 64), (70_000, 3), (5, 1), (2, 1), (9000, 300)])
def test_compiled_sums_of_repeats_are_numpys_bit_for_bit(
    n: int, dim: int, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled sums add each row into its sum as numpy's chunked bincount does (the
    same order, so the same bits), across chunks and with values far apart in size."""
    rng = np.random.default_rng(n + dim)
    ids = (rng.zipf(1.2, n) % 5000).astype(np.int64)
    ids[:2] = 7  # (repeats, so summed)
    grads = (rng.standard_normal((n, dim)) * 10 ** rng.uniform(-30, 30, (n, dim))).astype(dtype)
    if n % 2:  # (unaligned, as gradients read where they lie in a frame)
        raw = np.empty(grads.nbytes + 1, np.uint8)
        unaligned = np.frombuffer(raw.data, dtype, grads.size, offset=1).reshape(n, dim)
        unaligned[...] = grads
        grads = unaligned
    # (and read where they lie, as a table's push: ids[i]'s gradient at grads[at[i]])
    at = rng.permutation(n)
    uniq, sums = sum_duplicates(ids, grads, np.float64)
    uniq_at, sums_at = sum_duplicates(ids, grads[np.argsort(at)], np.float64, at)
    monkeypatch.setattr(rowcopy, "_crows", None)
    numpy_uniq, numpy_sums = sum_duplicates(ids, grads, np.float64)
    assert uniq.tolist() == numpy_uniq.tolist() == uniq_at.tolist()
    assert sums.shape == numpy_sums.shape and sums.tobytes() == numpy_sums.tobytes()
    assert sums_at.tobytes() == numpy_sums.tobytes()
    assert sum_duplicates(ids, grads[np.argsort(at)], np.float64, at)[1].tobytes() == (
        numpy_sums.tobytes()
    )  # (the numpy path, given where they lie)


@pytest.mark.skipif(rowcopy._crows is None, reason="the compiled path is not built")
def test_the_compiled_distinct_ids_and_where_each_id_went_are_numpys() -> None:
    rng = np.random.default_rng(3)
    extremes = arr([0, -1, 2**63 - 1, -(2**63), 5, 5])
    for ids in (extremes, rng.integers(-(2**63), 2**63 - 1, 5000), rng.zipf(1.2, 9000)):
        ids = np.concatenate([ids, ids[: len(ids) // 3]]).astype(np.int64)
        uniq, inverse = rowcopy._unique(rowcopy._crows, ids)
        numpy_uniq, numpy_inverse = np.unique(ids, return_inverse=True)
        assert uniq.tolist() == numpy_uniq.tolist()
        assert inverse.tolist() == numpy_inverse.reshape(-1).tolist()


@pytest.mark.skipif(rowcopy._crows is None, reason="the compiled path is not built")
def test_compiled_sums_refuse_bad_rows_and_add_nothing() -> None:
    sum_rows = rowcopy._crows.sum_rows
    grads, sums = np.ones((3, 2), np.float32), np.zeros((2, 2))
    with pytest.raises(IndexError, match="out of 2"):
        sum_rows(arr([0, 2, 1]), grads, sums, 4)
    with pytest.raises(IndexError, match="out of 2"):
        sum_rows(arr([0, -1, 1]), grads, sums, 4)
    assert not sums.any()
    with pytest.raises(ValueError, match="a row a gradient"):
        sum_rows(arr([0, 1]), grads, sums, 4)
    with pytest.raises(ValueError, match="as wide"):
        sum_rows(arr([0, 1, 1]), grads, np.zeros((2, 3)), 4)
    with pytest.raises(ValueError, match="one row or more"):
        sum_rows(arr([0, 1, 1]), grads, sums, 0)
    with pytest.raises(IndexError, match="gradient 3 is out of bounds"):
        sum_rows(arr([0, 1, 1]), grads, sums, 4, arr([0, 3, 1]))
    with pytest.raises(ValueError, match="a row a gradient"):
        sum_rows(arr([0, 1, 1]), grads, sums, 4, arr([0, 1]))
    assert not sums.any()
    sum_rows(arr([0, 1, 1]), grads * arr([[1], [2], [4]]), sums, 4, arr([2, 0, 2]))
    assert sums.tolist() == [[4.0, 4.0], [5.0, 5.0]]
    sums[:] = 0
    sum_rows(arr([0, 1, 1]), grads, sums, 1)
    assert sums.tolist() == [[1.0, 1.0], [2.0, 2.0]]


def reference(rule: RowRule, w0: dict, batches) -> dict:
    """The rules in float64, one row at a time; adam counts each row's own steps.

    adam adds eps to sqrt(v), not to sqrt(v) / sqrt(1 - beta2^t) (torch.optim.SparseAdam's
    arithmetic; torch.optim.Adam's differs by that epsilon's scale).
    """
    w = {i: v.astype(np.float64) for i, v in w0.items()}
    s = {i: np.full_like(v, rule.initial_accumulator) for i, v in w.items()}
    m = {i: np.zeros_like(v) for i, v in w.items()}
    v2 = {i: np.zeros_like(v) for i, v in w.items()}
    t = dict.fromkeys(w, 0)
    for ids, grads in batches:
        summed: dict = {}
        for i, g in zip(ids.tolist(), grads.astype(np.float64), strict=True):
            summed[i] = summed.get(i, 0) + g
        for i, g in summed.items():
            if rule.kind == "sgd":
                w[i] = w[i] - rule.lr * g
            elif rule.kind == "adagrad":
                s[i] = s[i] + g * g
                w[i] = w[i] - rule.lr * g / (np.sqrt(s[i]) + rule.eps)
            else:
                t[i] += 1
                m[i] = rule.beta1 * m[i] + (1 - rule.beta1) * g
                v2[i] = rule.beta2 * v2[i] + (1 - rule.beta2) * g * g
                size = rule.lr * np.sqrt(1 - rule.beta2 ** t[i]) / (1 - rule.beta1 ** t[i])
                w[i] = w[i] - size * m[i] / (np.sqrt(v2[i]) + rule.eps)
    return w


def batches_of(ids: np.ndarray, dim: int, steps: int, seed: int, same_rows: bool = False):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        batch = ids if same_rows else rng.choice(ids, 12)  # repeats: duplicates to sum
        out.append((batch, rng.standard_normal((len(batch), dim)).astype(np.float32)))
    return out


RULES = [sgd(0.1), adagrad(0.1, initial_accumulator=0.1), adam(0.01, betas=(0.8, 0.9))]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.kind)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rules_follow_a_numpy_reference(rule, dtype) -> None:
    ids = arr([I64.min, -7, 0, 3, 10**12, I64.max])
    block = RowBlock(BlockSpec("emb", 4, dtype, init=normal(1.0), rule=rule))
    w0 = dict(zip(ids.tolist(), block.pull(ids), strict=True))
    batches = batches_of(ids, 4, 8, seed=6)
    for step, (batch, grads) in enumerate(batches):
        block.fold(batch, grads.astype(dtype), now=float(step))
    expected = reference(rule, w0, batches)
    tolerance = 1e-12 if dtype == "float64" else 1e-5
    for i, row in zip(ids.tolist(), block.pull(ids), strict=True):
        np.testing.assert_allclose(row, expected[i], rtol=tolerance, atol=tolerance)


def torch_run(torch, rule: RowRule, w0: np.ndarray, batches, index_of):
    emb = torch.nn.Embedding(len(w0), w0.shape[1], sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(w0))
    if rule.kind == "sgd":
        opt = torch.optim.SGD(emb.parameters(), lr=rule.lr)
    elif rule.kind == "adagrad":
        opt = torch.optim.Adagrad(
            emb.parameters(),
            lr=rule.lr,
            eps=rule.eps,
            initial_accumulator_value=rule.initial_accumulator,
        )
    else:
        opt = torch.optim.SparseAdam(
            emb.parameters(), lr=rule.lr, betas=(rule.beta1, rule.beta2), eps=rule.eps
        )
    with torch.sparse.check_sparse_tensor_invariants():  # opting in silences torch's warning
        for ids, grads in batches:
            opt.zero_grad()
            positions = torch.from_numpy(np.array([index_of[i] for i in ids.tolist()]))
            (emb(positions) * torch.from_numpy(grads)).sum().backward()  # d/d row = grads
            opt.step()
    return emb.weight.detach().numpy()


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.kind)
def test_rules_follow_torch_sparse_embeddings(rule) -> None:
    torch = pytest.importorskip("torch")
    ids = arr([I64.max, -12, 5, 0, 99, 10**17, -(10**17), 42])
    index_of = {i: k for k, i in enumerate(ids.tolist())}
    block = RowBlock(BlockSpec("emb", 16, init=uniform(0.3), rule=rule))
    w0 = block.pull(ids)
    # SparseAdam's one global step equals the per-row steps when every step touches every row.
    batches = batches_of(ids, 16, 10, seed=7, same_rows=rule.kind == "adam")
    if rule.kind == "adam":  # with duplicates as well: summed before the fold, as torch does
        batches = [(np.concatenate([b, b[:3]]), np.concatenate([g, g[:3]])) for b, g in batches]
    expected = torch_run(torch, rule, w0, batches, index_of)
    for step, (batch, grads) in enumerate(batches):
        block.fold(batch, grads, now=float(step))
    np.testing.assert_allclose(block.pull(ids), expected, rtol=1e-5, atol=1e-6)


def test_lazy_adam_counts_steps_per_row_unlike_sparse_adam() -> None:
    torch = pytest.importorskip("torch")
    ids = arr([1, 2])
    rule = adam(0.1)
    block = RowBlock(BlockSpec("emb", 3, init=normal(1.0), rule=rule))
    w0 = block.pull(ids)
    g = np.ones((1, 3), np.float32)
    batches = [(arr([1]), g), (arr([1]), g), (arr([2]), g)]  # row 2's first fold: global step 3
    for step, (batch, grads) in enumerate(batches):
        block.fold(batch, grads, now=float(step))
    assert block.export()["step"].tolist() == [2, 1]
    expected = reference(rule, dict(zip([1, 2], w0, strict=True)), batches)
    np.testing.assert_allclose(block.pull(ids)[1], expected[2], rtol=1e-6)
    # A first step moves a row by lr whatever its gradient; SparseAdam's step-3 bias
    # correction moves row 2 by less.
    np.testing.assert_allclose(block.pull(ids)[1], w0[1] - 0.1, rtol=1e-6)
    sparse_adam = torch_run(torch, rule, w0, batches, {1: 0, 2: 1})
    assert not np.allclose(sparse_adam[1], block.pull(ids)[1], rtol=1e-3)


# -- the block: bad input, eviction, snapshots, replication, memory ---------------------------


def adam_block() -> RowBlock:
    block = RowBlock(BlockSpec("emb", 4, init=normal(0.1), rule=adam(0.01)))
    block.fold(arr([1, 2, 3]), np.ones((3, 4), np.float32), now=1.0)
    return block


def same_export(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


GOOD_IDS, GOOD_GRADS = arr([1, 7]), np.ones((2, 4), np.float32)
NAN_GRADS = np.array([[1, 2, 3, 4], [1, np.nan, 3, 4]], np.float32)


@pytest.mark.parametrize(
    ("ids", "grads"),
    [
        (GOOD_IDS.astype(np.float64), GOOD_GRADS),
        (GOOD_IDS.astype(np.int32), GOOD_GRADS),
        (GOOD_IDS.reshape(2, 1), GOOD_GRADS),
        (GOOD_IDS, np.ones((2, 5), np.float32)),  # the wrong width
        (GOOD_IDS, np.ones((3, 4), np.float32)),  # the wrong count
        (GOOD_IDS, np.ones(8, np.float32)),
        (GOOD_IDS, np.ones((2, 4), np.int64)),
        (GOOD_IDS, NAN_GRADS),
        (GOOD_IDS, GOOD_GRADS * np.inf),
    ],
)
def test_bad_folds_change_nothing(ids, grads) -> None:
    block = adam_block()
    before, capacity = block.export(), block.capacity
    with pytest.raises(RequestError) as caught:
        block.fold(ids, grads, now=2.0)
    assert caught.value.message
    assert same_export(block.export(), before) and block.capacity == capacity


def test_bad_times_and_merges_change_nothing() -> None:
    block = adam_block()
    before = block.export()
    good = block.rows_of(arr([1, 2]))
    bad_calls = [
        lambda: block.fold(GOOD_IDS, GOOD_GRADS, now=float("nan")),
        lambda: block.pull(GOOD_IDS, now=float("inf")),
        lambda: block.pull(GOOD_IDS.astype(np.uint64)),
        lambda: block.merge(good.ids, good.rows, {**good.state, "step": arr([3, -1])}),
        lambda: block.merge(arr([1, 1]), good.rows, good.state),
        lambda: block.merge(good.ids, good.rows, {"step": good.state["step"]}),
        lambda: block.merge(
            good.ids, good.rows, {**good.state, "exp_avg_sq": -good.state["exp_avg_sq"] - 1}
        ),
        lambda: block.evict(float("nan")),
    ]
    for call in bad_calls:
        with pytest.raises(RequestError):
            call()
        assert same_export(block.export(), before)


def test_pull_peek_and_times() -> None:
    block = RowBlock(BlockSpec("emb", 3, init=uniform(1.0)))
    rows, found = block.peek(arr([4, 5]))
    assert not found.any() and len(block) == 0
    assert np.array_equal(block.pull(arr([5, 4, 5]), now=3.0), rows[[1, 0, 1]])
    block.pull(arr([6]))  # made without a time: the latest the block has seen
    assert block.export()["touched"].tolist() == [3.0, 3.0, 3.0]
    block.fold(arr([6]), np.ones((1, 3), np.float32), now=9.0)
    rows, found = block.peek(arr([6, 8]))
    assert found.tolist() == [True, False] and len(block) == 3
    assert np.array_equal(rows[0], block.pull(arr([6]))[0])
    assert block.fold(arr([]), np.ones((0, 3)), now=10.0).size == 0  # nothing to fold
    assert block.pull(arr([])).shape == (0, 3) and len(block) == 3


def test_evict_drops_old_rows_keeps_the_rest() -> None:
    block = RowBlock(BlockSpec("emb", 4, init=normal(0.1), rule=adagrad(0.1)))
    old, new = np.arange(0, 5000, dtype=np.int64), np.arange(5000, 6000, dtype=np.int64)
    block.fold(old, np.ones((5000, 4), np.float32), now=1.0)
    block.fold(new, np.ones((1000, 4), np.float32), now=2.0)
    kept = block.rows_of(new)
    capacity = block.capacity
    assert sorted(block.evict(1.5).tolist()) == old.tolist()
    assert len(block) == 1000 and block.capacity < capacity  # memory given back
    again = block.rows_of(new)
    assert np.array_equal(again.rows, kept.rows) and np.array_equal(
        again.state["sum"], kept.state["sum"]
    )
    rows, found = block.peek(old[:3])
    assert not found.any()
    assert np.array_equal(rows, normal(0.1).values("emb", old[:3], 4))  # made anew on touch
    assert block.evict(0.0).size == 0


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.kind)
def test_export_rebuild_and_merge_replicate_exactly(rule) -> None:
    spec = BlockSpec("emb", 5, init=normal(0.1), rule=rule)
    block, replica = RowBlock(spec), RowBlock(spec)
    for step, (batch, grads) in enumerate(batches_of(arr([-4, 8, 15, 16, 23, 42]), 5, 4, 8)):
        changed = block.fold(batch, grads, now=float(step))
        replica.merge(*block.rows_of(changed), now=float(step))
    rebuilt = RowBlock.from_export(spec, block.export())
    assert same_export(rebuilt.export(), block.export())
    assert same_export(replica.export(), block.export())
    for other in (rebuilt, replica):  # and they go on identically
        other.fold(arr([8, 99]), np.ones((2, 5), np.float32), now=9.0)
    block.fold(arr([8, 99]), np.ones((2, 5), np.float32), now=9.0)
    assert same_export(rebuilt.export(), block.export())
    assert same_export(replica.export(), block.export())
    with pytest.raises(RequestError):
        RowBlock.from_export(spec, {**block.export(), "extra": np.zeros(1)})


def test_memory_per_row() -> None:
    dim, n = 64, 100_000
    block = RowBlock(BlockSpec("emb", dim, rule=sgd(0.1)))
    ids = distinct_ids(9, n)
    for start in range(0, n, 1000):  # batch by batch: the blocks grow in chunks
        block.pull(ids[start : start + 1000], now=1.0)
    memory = block.memory()
    assert len(block) == n and memory["state"] == 0
    row_bytes = dim * np.dtype(np.float32).itemsize
    # rows + last-touched times, their spare capacity counted: within 1.3x of the row data.
    assert (block.nbytes - memory["index"]) / n <= 1.3 * row_bytes
    assert memory["index"] / n <= 64  # 8 bytes a bucket, 8 an id in the slot -> id array
    assert "100000 rows" in repr(block)


# -- moving rows: put_rows and take_rows against numpy's own indexing -----------------------

ROW_DTYPES = ["float32", "float16", "float64", "bfloat16"]


@pytest.mark.parametrize("dtype", ROW_DTYPES)
@pytest.mark.parametrize("dim", [1, 3, 64])
def test_put_rows_and_take_rows_move_what_numpy_indexing_moves(dtype: str, dim: int) -> None:
    dt = parse_dtype(dtype)
    rng = np.random.default_rng(dim)
    source = rng.standard_normal((50, dim)).astype(dt)
    slots = rng.integers(0, 50, 200)
    where = rng.permutation(300)[:200]
    out, expected = np.zeros((300, dim), dt), np.zeros((300, dim), dt)
    put_rows(out, where, source, slots)
    expected[where] = source[slots]
    assert out.tobytes() == expected.tobytes()
    put_rows(out, where[:50], source)  # (no slots: the rows in their order)
    expected[where[:50]] = source
    assert out.tobytes() == expected.tobytes()
    assert take_rows(source, slots).tobytes() == source[slots].tobytes()


def test_put_rows_converts_other_dtypes_and_takes_views_that_are_not_contiguous() -> None:
    source = np.arange(40, dtype=np.float64).reshape(10, 4)
    out = np.zeros((10, 4), np.float32)
    put_rows(out, np.arange(10)[::-1], source)  # (float64 into float32: as numpy converts)
    np.testing.assert_array_equal(out, source[::-1].astype(np.float32))
    strided = np.arange(80, dtype=np.float32).reshape(10, 8)[:, ::2]  # (a view, every other)
    out = np.zeros((10, 4), np.float32)
    put_rows(out, np.arange(10), strided, np.arange(10)[::-1])
    np.testing.assert_array_equal(out, strided[::-1])
    assert take_rows(strided, np.array([3, 1])).tolist() == strided[[3, 1]].tolist()


@pytest.mark.skipif(rowcopy._crows is None, reason="the compiled path is not built")
def test_the_compiled_row_copy_refuses_rows_out_of_bounds_and_writes_nothing() -> None:
    source, out = np.ones((4, 2), np.float32), np.zeros((4, 2), np.float32)
    for slots, where in (([0, 4], [0, 1]), ([0, 1], [0, -1]), ([-1], [0])):
        with pytest.raises(IndexError, match="out of bounds"):
            put_rows(out, arr(where), source, arr(slots))
        assert not out.any()
    with pytest.raises(ValueError, match="one length"):
        put_rows(out, arr([0, 1]), source, arr([0]))


@pytest.mark.skipif(rowindex._crows is None, reason="the compiled path is not built")
@pytest.mark.parametrize("buckets", [1, 7, 64, 1000, 2**20, 2**31 - 1])
def test_the_compiled_hashes_are_placements(buckets: int) -> None:
    rng = np.random.default_rng(buckets)
    extremes = [0, 1, -1, 2**63 - 1, -(2**63), 2**32, -(2**32)]
    ids = np.concatenate([np.array(extremes, np.int64), rng.integers(-(2**63), 2**63 - 1, 5000)])
    expected = placement.bucket_of(ids, buckets)
    assert rowindex.bucket_of(ids, buckets).tolist() == expected.tolist()
    index = RowIndex()
    index.insert(ids[: buckets % 3000 + 1])  # (tables of several sizes, so masks)
    mask = index._mask
    assert index._home(ids).tolist() == (placement.mix64(ids.view(np.uint64)) & mask).tolist()


@pytest.mark.skipif(rowindex._crows is None, reason="the compiled path is not built")
def test_the_compiled_hashes_refuse_what_they_cannot_hash() -> None:
    c, ids = rowindex._crows, np.arange(4, dtype=np.int64)
    with pytest.raises(ValueError, match="one bucket or more"):
        c.buckets(ids, 0, np.empty(4, np.int64))
    with pytest.raises(ValueError, match="one length"):
        c.buckets(ids, 8, np.empty(3, np.int64))
    with pytest.raises(ValueError, match="not negative"):
        c.homes(ids, -1, np.empty(4, np.int64))
    # Other dtypes and layouts are hashed by numpy, the same
    strided = np.arange(20, dtype=np.int64)[::2]
    assert rowindex.bucket_of(strided, 8).tolist() == placement.bucket_of(strided, 8).tolist()
    small = np.arange(10, dtype=np.int32)
    assert rowindex.bucket_of(small, 8).tolist() == placement.bucket_of(small, 8).tolist()


@pytest.mark.skipif(rows_module._crowfold is None, reason="the compiled path is not built")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("rule", [sgd(0.1), adagrad(0.5, eps=1e-6), adagrad(1e-3, eps=1e-50)])
def test_a_compiled_row_fold_is_numpys_bit_for_bit(rule: RowRule, dtype: str) -> None:
    rng = np.random.default_rng(len(dtype))
    spec = BlockSpec("emb", 17, dtype, init=normal(1.0, seed=5), rule=rule)
    compiled = RowBlock(spec)
    start = rng.standard_normal((300, 17)) * 10 ** rng.uniform(-20, 20, (300, 17))
    compiled.assign(np.arange(300, dtype=np.int64), start.astype(dtype), 1.0)
    numpy_block = RowBlock.from_export(spec, compiled.export())
    for _ in range(3):
        slots = rng.permutation(300)[:200].astype(np.int64)
        g = (rng.standard_normal((200, 17)) * 10 ** rng.uniform(-30, 30, (200, 17))).astype(dtype)
        g[rng.integers(0, 200, 3), rng.integers(0, 17, 3)] = [np.inf, -0.0, np.nan]
        compiled._fold_rows(slots, g)
        with np.errstate(all="ignore"):
            numpy_block._fold_chunk(slots, g)
        for name, mine in compiled.export().items():
            theirs = numpy_block.export()[name]
            nan = np.isnan(theirs) if theirs.dtype.kind == "f" else np.zeros(theirs.shape, bool)
            assert np.array_equal(np.isnan(mine) if mine.dtype.kind == "f" else nan, nan), name
            assert mine[~nan].tobytes() == theirs[~nan].tobytes(), name


@pytest.mark.skipif(rows_module._crowfold is None, reason="the compiled path is not built")
def test_a_compiled_row_fold_refuses_bad_slots_and_writes_nothing() -> None:
    rows, sums = np.ones((4, 3), np.float32), np.ones((4, 3), np.float32)
    g = np.ones((2, 3), np.float32)
    fold = rows_module._crowfold.fold_rows
    for slots, error, match in (
        ([0, 4], IndexError, "out of bounds"),
        ([-1, 0], IndexError, "out of bounds"),
        ([1, 1], ValueError, "folded twice"),
    ):
        with pytest.raises(error, match=match):
            fold(rows, sums, arr(slots), g, 0.1, 1e-6, True)
        assert (rows == 1).all() and (sums == 1).all()
    with pytest.raises(ValueError, match="len\\(slots\\)"):
        fold(rows, sums, arr([0]), g, 0.1, 1e-6, True)
    with pytest.raises(ValueError, match="sums are of the rows' shape"):
        fold(rows, sums[:2], arr([0, 1]), g, 0.1, 1e-6, True)
    # gradients by index (a table's push, each bucket's where it lies)
    for grad_rows, error in (([0, 2], IndexError), ([-1, 0], IndexError), ([0], ValueError)):
        with pytest.raises(error):
            fold(rows, sums, arr([0, 1]), g, 0.1, 1e-6, True, arr(grad_rows))
        assert (rows == 1).all() and (sums == 1).all()
    grads = np.array([[9.0] * 3, [3.0] * 3], np.float32)
    fold(rows, sums, arr([2, 0]), grads, 1.0, 1e-6, False, arr([1, 1]))
    assert rows[:, 0].tolist() == [-2.0, 1.0, -2.0, 1.0]


@pytest.mark.parametrize("n", [0, 1, 2, 15, 16, 17, 1000, 100_000])
def test_duplicates_are_found_wherever_they_are(n: int) -> None:
    rng = np.random.default_rng(n)
    ids = rng.choice(2**62, n, replace=False).astype(np.int64) - 2**61
    assert not rowindex.has_duplicates(ids)
    for first, second in ((0, n - 1), (n // 2, n // 2 + 1), (n - 2, n - 1)):
        if 0 <= first < second < n:
            twice = ids.copy()
            twice[second] = twice[first]
            assert rowindex.has_duplicates(twice), (n, first, second)
    extremes = np.array([-(2**63), 2**63 - 1, 0, -1], np.int64)
    assert not rowindex.has_duplicates(extremes)
    assert rowindex.has_duplicates(np.append(extremes, -(2**63)))
    assert rowindex.has_duplicates(np.zeros(n + 2, np.int64))


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_rows_decoded_from_the_wire_are_of_numpys_own_dtype(dtype: str) -> None:
    """Rows (and a delta's) decoded from little-endian bytes come as numpy's own dtype
    instance, which the compiled paths know a dtype by (a dtype made little-endian
    again is equal but another object, and the finite check fell back to numpy)."""
    from aioparamsync.values import rules
    from aioparamsync.values.rowwire import decode_rows, encode_rows

    rows = np.ones((3, 4), dtype)
    decoded = decode_rows(encode_rows(rows), count=3, dim=4)
    assert decoded.dtype is np.dtype(dtype)
    if dtype != "float16":
        assert rules._compiled_dtype(decoded)
