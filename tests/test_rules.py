"""Gradient rules (sum, sgd, adam) against references, and the table's fold: whole or nothing."""

from __future__ import annotations

import math

import numpy as np
import pytest

from aioparamsync import ErrorCode, RequestError, adam, sgd, sum_rule, thrift, to_parameter
from aioparamsync.store.table import ParameterTable
from aioparamsync.values import rules
from aioparamsync.values.rules import State, check_rule, fold

RNG = np.random.default_rng(7)
STEPS = 25


def reference_sgd(w, grads, lr, momentum, weight_decay):
    """SGD as its textbook (and torch.optim.SGD's documentation) writes it, in float64."""
    w = w.astype(np.float64)
    buf = None
    for g in grads:
        d = g + weight_decay * w
        if momentum:
            buf = d.copy() if buf is None else momentum * buf + d
            d = buf
        w = w - lr * d
    return w


def reference_adam(w, grads, lr, b1, b2, eps, weight_decay):
    """Adam as Kingma & Ba (and torch.optim.Adam's documentation) write it, in float64."""
    w = w.astype(np.float64)
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, g in enumerate(grads, 1):
        g = g + weight_decay * w
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat = m / (1 - b1**t)
        v_hat = v / (1 - b2**t)
        w = w - lr * m_hat / (np.sqrt(v_hat) + eps)
    return w


def run(rule, w, grads):
    state = None
    for g in grads:
        w, state = fold(rule, w, g, state)
    return w, state


def problem(dtype=np.float64, shape=(4, 5)):
    w = RNG.standard_normal(shape).astype(dtype)
    grads = [RNG.standard_normal(shape).astype(dtype) for _ in range(STEPS)]
    return w, grads


def test_sum_adds_every_gradient() -> None:
    w, grads = problem()
    got, state = run(sum_rule(), w, grads)
    np.testing.assert_allclose(got, w + np.sum(grads, axis=0), rtol=1e-12)
    assert state.step == STEPS


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_sgd_matches_the_reference(momentum: float, weight_decay: float) -> None:
    w, grads = problem()
    got, _ = run(sgd(0.05, momentum=momentum, weight_decay=weight_decay), w, grads)
    want = reference_sgd(w, grads, 0.05, momentum, weight_decay)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_adam_matches_the_reference(weight_decay: float) -> None:
    w, grads = problem()
    rule = adam(0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay)
    got, state = run(rule, w, grads)
    # torch's form (eps added to sqrt(v)/sqrt(1-b2^t)) equals the paper's exactly.
    want = reference_adam(w, grads, 0.01, 0.8, 0.99, 1e-6, weight_decay)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    assert state.step == STEPS and state.momentum is not None and state.variance is not None


def test_fold_leaves_its_inputs_alone() -> None:
    w, grads = problem()
    w.flags.writeable = False
    before = w.copy()
    _, state = fold(sgd(0.1, momentum=0.9), w, grads[0], None)
    assert state.momentum is not None
    momentum = state.momentum.copy()
    fold(sgd(0.1, momentum=0.9), w, grads[1], state)
    np.testing.assert_array_equal(w, before)
    np.testing.assert_array_equal(state.momentum, momentum)


def test_float32_stays_float32_and_float16_is_computed_in_float32() -> None:
    w, grads = problem(np.float32)
    got, _ = run(sgd(0.05, momentum=0.9), w, grads)
    assert got.dtype == np.float32
    want = reference_sgd(w, grads, 0.05, 0.9, 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    half, _ = fold(sgd(0.5), np.ones(3, np.float16), np.ones(3, np.float16), None)
    assert half.dtype == np.float16 and half.tolist() == [0.5, 0.5, 0.5]


def test_torch_optimizers_agree() -> None:
    torch = pytest.importorskip("torch")
    w, grads = problem(np.float64)
    for rule, make in [
        (
            sgd(0.05, momentum=0.9, weight_decay=0.01),
            lambda p: torch.optim.SGD([p], lr=0.05, momentum=0.9, weight_decay=0.01),
        ),
        (
            adam(0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01),
            lambda p: torch.optim.Adam(
                [p], lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01
            ),
        ),
    ]:
        p = torch.nn.Parameter(torch.tensor(w))
        opt = make(p)
        for g in grads:
            p.grad = torch.tensor(g)
            opt.step()
        got, _ = run(rule, w, grads)
        np.testing.assert_allclose(got, p.detach().numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "fields",
    [
        {"kind": "momentum"},
        {"kind": "sgd", "lr": -0.1},
        {"kind": "sgd", "lr": math.nan},
        {"kind": "sgd", "lr": math.inf},
        {"kind": "sgd", "momentum": 1.0},
        {"kind": "sgd", "weight_decay": -1.0},
        {"kind": "adam", "beta1": 1.0},
        {"kind": "adam", "beta2": -0.5},
        {"kind": "adam", "eps": 0.0},
    ],
)
def test_bad_rules_are_refused(fields: dict) -> None:
    with pytest.raises(RequestError) as info:
        check_rule("w", thrift.Rule(**fields))
    assert info.value.code == ErrorCode.BAD_REQUEST
    assert "'w'" in str(info.value)


# -- the table ------------------------------------------------------------------------------


def grad(name: str, array) -> object:
    return to_parameter(name, np.asarray(array))


def table_with(**arrays) -> ParameterTable:
    table = ParameterTable("n")
    params = []
    for name, (array, rule) in arrays.items():
        p = to_parameter(name, np.asarray(array))
        p.rule = rule
        params.append(p)
    table.apply(params, 1)
    return table


def value(table: ParameterTable, name: str) -> np.ndarray:
    entry = table.entry(name)
    assert entry is not None
    return np.frombuffer(entry.data, dtype=entry.dtype).reshape(entry.shape)


def test_fold_bumps_versions_and_keeps_layout_and_rule() -> None:
    table = table_with(w=(np.ones((2, 2), np.float32), sgd(0.5)))
    applied = table.fold([grad("w", np.ones((2, 2), np.float16))], 5)
    entry = table.entry("w")
    assert entry is not None
    assert applied.entries == (entry,)
    assert (entry.version, entry.dtype, entry.shape) == (2, "<f4", (2, 2))
    assert entry.rule == sgd(0.5)
    assert entry.data.readonly
    np.testing.assert_array_equal(value(table, "w"), np.full((2, 2), 0.5, np.float32))
    assert table.timestamp == 5


@pytest.mark.parametrize(
    ("grads", "code"),
    [
        ([grad("w", [1.0, 1.0]), grad("nope", [1.0])], ErrorCode.UNKNOWN_PARAMETER),
        ([grad("w", [1.0, 1.0]), grad("plain", [1.0, 1.0])], ErrorCode.BAD_REQUEST),
        ([grad("w", [1.0, 1.0]), grad("v", [1.0, 1.0, 1.0])], ErrorCode.SHAPE_MISMATCH),
        ([grad("w", [1.0, 1.0]), grad("v", [[1.0], [1.0]])], ErrorCode.SHAPE_MISMATCH),
        ([grad("w", [1.0, 1.0]), grad("w", [1.0, 1.0])], ErrorCode.BAD_REQUEST),
        ([grad("w", [True, False])], ErrorCode.SHAPE_MISMATCH),
        ([grad("", [1.0])], ErrorCode.BAD_REQUEST),
    ],
)
def test_a_bad_gradient_changes_nothing(grads, code) -> None:
    table = table_with(
        w=([1.0, 2.0], sgd(0.1, momentum=0.9)),
        v=([1.0, 2.0], sum_rule()),
        plain=([1.0, 2.0], None),
    )
    table.fold([grad("w", [1.0, 1.0])], 2)  # some momentum state
    state = table.state("w")
    before = {n: (table.entry(n).version, bytes(table.entry(n).data)) for n in ("w", "v", "plain")}
    with pytest.raises(RequestError) as info:
        table.fold(grads, 3)
    assert info.value.code == code
    after = {n: (table.entry(n).version, bytes(table.entry(n).data)) for n in ("w", "v", "plain")}
    assert after == before
    assert table.state("w") is state


def test_a_plain_gradient_without_dtype_is_refused() -> None:
    table = table_with(w=([1.0, 2.0], sum_rule()))
    plain = thrift.Parameter(name="w", data=b"\0" * 16)
    with pytest.raises(RequestError) as info:
        table.fold([plain], 1)
    assert info.value.code == ErrorCode.SHAPE_MISMATCH


def test_rules_need_a_dtype_they_can_fold() -> None:
    table = ParameterTable("n")
    for array, rule in [
        (np.arange(3, dtype=np.int32), sgd(0.1)),
        (np.array([True]), sum_rule()),
        (np.zeros(2, np.complex64), adam()),
    ]:
        p = to_parameter("x", array)
        p.rule = rule
        with pytest.raises(RequestError) as info:
            table.apply([p], 1)
        assert info.value.code == ErrorCode.BAD_REQUEST
    plain = thrift.Parameter(name="x", data=b"abcd", rule=sum_rule())
    with pytest.raises(RequestError):
        table.apply([plain], 1)
    counter = to_parameter("n", np.zeros(2, np.int64))
    counter.rule = sum_rule()
    table.apply([counter], 1)
    table.fold([grad("n", np.array([1, 2], np.int64))], 2)
    assert value(table, "n").tolist() == [1, 2]
    assert len(table) == 1


@pytest.mark.parametrize(
    ("dtype", "start", "add", "total"),
    [
        (np.int64, 2**40, 1, 2**40 + 1),
        (np.int32, 2**24 + 1, 0, 2**24 + 1),  # float32 would make it 2**24
        (np.uint8, 255, 1, 0),  # wraps around, as torch's integer tensors do
    ],
)
def test_sum_adds_integers_exactly_in_their_own_type(dtype, start, add, total) -> None:
    table = ParameterTable("n")
    counter = to_parameter("n", np.array([start], dtype))
    counter.rule = sum_rule()
    table.apply([counter], 1)
    table.fold([grad("n", np.array([add], dtype))], 2)
    assert value(table, "n").tolist() == [total]
    assert value(table, "n").dtype == dtype


def test_an_update_keeps_the_rule_and_a_new_rule_starts_the_state_over() -> None:
    table = table_with(w=([1.0, 1.0], sgd(0.1, momentum=0.9)))
    table.fold([grad("w", [1.0, 1.0])], 2)
    assert table.state("w").momentum is not None
    # A plain update of the values keeps the rule and the optimizer's state.
    table.apply([to_parameter("w", np.array([5.0, 5.0]))], 3)
    assert table.entry("w").rule == sgd(0.1, momentum=0.9)
    assert table.state("w").step == 1
    # A new rule, or a new layout, starts over.
    p = to_parameter("w", np.array([5.0, 5.0]))
    p.rule = adam()
    table.apply([p], 4)
    assert table.state("w") is None
    table.fold([grad("w", [1.0, 1.0])], 5)
    p = to_parameter("w", np.zeros(3))
    p.replace = True
    table.apply([p], 6)
    assert table.state("w") is None
    # Floats replaced by bytes: no rule applies any more.
    table.apply([thrift.Parameter(name="w", data=b"abc", replace=True)], 7)
    assert table.entry("w").rule is None


def test_merged_entries_carry_their_rule() -> None:
    table = ParameterTable("n")
    p = to_parameter("w", np.ones(2))
    p.rule, p.version, p.origin = sgd(0.3), 4, "other@1"
    table.merge([p], 1)
    table.fold([grad("w", [1.0, 1.0])], 2)
    np.testing.assert_allclose(value(table, "w"), [0.7, 0.7])
    assert table.entry("w").version == 5


def test_state_is_a_fresh_object_each_step() -> None:
    table = table_with(w=([1.0], adam()))
    table.fold([grad("w", [1.0])], 1)
    first = table.state("w")
    table.fold([grad("w", [1.0])], 2)
    assert table.state("w") is not first
    assert isinstance(first, State) and first.step == 1


def test_a_folded_value_is_stored_without_a_copy() -> None:
    table = table_with(w=(np.ones(1000, np.float32), sgd(0.5)))
    table.fold([grad("w", np.ones(1000, np.float32))], 1)
    entry = table.entry("w")
    assert entry is not None and entry.data.readonly
    # The entry holds what the rule wrote, not bytes copied out of it: numpy's array, or
    # the compiled fold's own bytes (written once, by the fold).
    assert isinstance(entry.data.obj, bytes if rules._cfold is not None else np.ndarray)
    if rules._cfold is None:
        assert np.shares_memory(entry.array, np.frombuffer(entry.data, np.float32))


CHECKED = [sum_rule(), sgd(0.1), sgd(0.1, momentum=0.9), adam()]


@pytest.mark.parametrize(
    ("rule", "dtype"),
    [(r, d) for r in CHECKED for d in (np.float32, np.float64, np.float16)]
    + [(sum_rule(), np.int32)],  # (integers take sum alone)
    ids=lambda x: getattr(x, "kind", None) or np.dtype(x).name,
)
def test_a_fold_asked_to_check_refuses_nan_and_inf_and_else_folds_as_it_would(rule, dtype):
    from aioparamsync.values.rules import fold_into

    w = np.arange(2000).astype(dtype)
    g = np.ones(2000, dtype)
    with np.errstate(all="ignore"):
        checked, state = fold_into(rule, w, g, None, check="w")
        plain, _ = fold_into(rule, w, g, None)
        assert checked.tobytes() == plain.tobytes() and state.step == 1
        if dtype is np.int32:
            return  # (no NaN to hold)
        for bad in (np.nan, np.inf, -np.inf):
            for where in (0, 1999):
                g = np.ones(2000, dtype)
                g[where] = bad
                with pytest.raises(RequestError, match="gradient 'w' holds 1 of 2000") as info:
                    fold_into(rule, w, g, None, check="w")
                assert info.value.code == ErrorCode.BAD_REQUEST
                fold_into(rule, w, g, None)  # (not asked: folded)
                allowing = thrift.Rule(**{**rule.__dict__, "allow_nonfinite": True})
                fold_into(allowing, w, g, None, check="w")
