"""How a node folds gradients into parameters: ``sum``, ``sgd`` and ``adam``.

A parameter gets its rule (the IDL's ``Rule``) from the update that creates
it; ``push_gradients`` then folds each gradient ``g`` into the stored value
``w`` by that rule. The arithmetic is torch.optim's, so a model trained
through a node with the ``sgd`` or ``adam`` rule follows the same path as one
trained locally with ``torch.optim.SGD`` or ``torch.optim.Adam``:

- ``sum``: ``w += g`` (ps-lite / BytePS style aggregation).
- ``sgd``: ``g' = g + wd*w``; with momentum ``mu``, ``b = g'`` on the first
  step, then ``b = mu*b + g'``, and ``w -= lr*b`` (no momentum: ``w -= lr*g'``).
- ``adam``: ``g' = g + wd*w``; ``m = b1*m + (1-b1)*g'``,
  ``v = b2*v + (1-b2)*g'^2``; ``w -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)``.

A gradient holding NaN or inf is refused (:func:`check_finite`), so that one
worker's diverged step does not poison the value every worker reads, unless
its parameter's rule was made with ``allow_nonfinite=True``.

Nothing here knows of asyncio or the network: :func:`fold` is a function of
arrays, and what it keeps between steps (:class:`State`) is a new object
each step, so the store can compute a whole update before it changes
anything (an update is applied wholly or not at all).

A float32 or float64 parameter folds a gradient of its own dtype in one
compiled pass (``_cfold.pyx``: the same bits as numpy's, without its
temporaries and their fixed cost, most of a small tensor's fold) where it was
built; everything else, and the pure path, with numpy.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._ext import compiled
from ..blocks import empty_like
from ..errors import ErrorCode, RequestError
from ..wire import thrift
from .parallel import PART_BYTES, in_parts

__all__ = [
    "KINDS",
    "State",
    "adagrad",
    "adam",
    "all_finite",
    "check_finite",
    "check_rule",
    "fold",
    "sgd",
    "sum_rule",
]

KINDS = ("sum", "sgd", "adam")


def sum_rule(*, allow_nonfinite: bool = False) -> Any:
    """The rule ``w += g``.

    ``allow_nonfinite`` (every rule has it): fold gradients holding NaN or
    inf too; by default they are refused (see :func:`check_finite`).
    """
    return thrift.Rule(kind="sum", allow_nonfinite=allow_nonfinite)


def sgd(
    lr: float = 0.01,
    *,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    allow_nonfinite: bool = False,
) -> Any:
    """The rule of ``torch.optim.SGD(lr=lr, momentum=momentum, weight_decay=weight_decay)``."""
    return _checked(
        "sgd", lr=lr, momentum=momentum, weight_decay=weight_decay, allow_nonfinite=allow_nonfinite
    )


def adam(
    lr: float = 0.001,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    allow_nonfinite: bool = False,
) -> Any:
    """The rule of ``torch.optim.Adam(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)``."""
    beta1, beta2 = betas
    return _checked(
        "adam",
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        allow_nonfinite=allow_nonfinite,
    )


def _checked(kind: str, **fields: Any) -> Any:
    """The ``Rule`` of ``kind`` with ``fields``, checked (:func:`check_rule`)."""
    rule = thrift.Rule(kind=kind, **fields)
    check_rule(kind, rule)
    return rule


def adagrad(
    lr: float = 0.01,
    *,
    eps: float = 1e-10,
    initial_accumulator: float = 0.0,
    allow_nonfinite: bool = False,
) -> Any:
    """The rule of ``torch.optim.Adagrad(lr=lr, eps=eps,
    initial_accumulator_value=initial_accumulator)``, for embedding tables' rows
    (:meth:`~aioparamsync.ParameterClient.create_table`): ``s += g^2``;
    ``w -= lr * g / (sqrt(s) + eps)``."""
    return thrift.Rule(
        kind="adagrad",
        lr=lr,
        eps=eps,
        initial_accumulator=initial_accumulator,
        allow_nonfinite=allow_nonfinite,
    )


def check_finite(what: str, grad: np.ndarray, rule: Any) -> None:
    """Raise :class:`RequestError` (BAD_REQUEST) if ``grad`` holds NaN or inf and
    ``rule`` does not allow them (``allow_nonfinite``).

    One vectorized pass over the array; integer gradients have no such values.
    ``what`` names the gradient in the message (e.g. ``"gradient 'w'"``).
    """
    if grad.dtype.kind in "iub" or (rule is not None and rule.allow_nonfinite):
        return
    if all_finite(grad):
        return
    finite = np.isfinite(grad)
    bad = finite.size - int(np.count_nonzero(finite))
    raise RequestError(
        ErrorCode.BAD_REQUEST,
        f"{what} holds {bad} of {finite.size} values that are not finite (NaN or inf): "
        "nothing of the push was folded (a rule made with allow_nonfinite=True folds them)",
    )


def all_finite(a: np.ndarray) -> bool:
    """True if the float array ``a`` holds no NaN or inf: one compiled pass where it was
    built (float32 and float64, C-contiguous), else numpy's."""
    if _cfold is not None and _compiled_dtype(a):
        if a.nbytes < _SPLIT_BYTES:
            return bool(_cfold.all_finite(a))
        c, flat = _cfold, _flat(a)
        return all(in_parts(lambda p: c.all_finite(flat[p]), a.size, a.itemsize))
    # (the ufunc's own reduce: ndarray.all wraps it in Python)
    return bool(_all(np.isfinite(a).reshape(-1)))


def _number(name: str, rule: Any, field: str, low: float, high: float, *, open_high: bool) -> None:
    value = getattr(rule, field)
    ok = isinstance(value, (int, float)) and math.isfinite(value) and low <= value
    ok = ok and (value < high if open_high else value <= high)
    if not ok:
        bracket = ")" if open_high else "]"
        raise RequestError(
            ErrorCode.BAD_REQUEST,
            f"{name!r}: rule {rule.kind} needs {field} in [{low}, {high}{bracket}, not {value!r}",
        )


def check_rule(name: str, rule: Any) -> None:
    """Raise :class:`RequestError` (BAD_REQUEST) unless ``rule`` is a rule a node can apply."""
    if rule.allow_nonfinite is not None and not isinstance(rule.allow_nonfinite, bool):
        raise RequestError(
            ErrorCode.BAD_REQUEST,
            f"{name!r}: rule allow_nonfinite is True or False, not {rule.allow_nonfinite!r}",
        )
    if rule.kind not in KINDS:
        tables = " (adagrad is for embedding tables' rows)" if rule.kind == "adagrad" else ""
        raise RequestError(
            ErrorCode.BAD_REQUEST,
            f"{name!r}: unknown rule {rule.kind!r}; one of {', '.join(KINDS)}{tables}",
        )
    if rule.kind == "sum":
        return
    _number(name, rule, "lr", 0.0, math.inf, open_high=True)
    _number(name, rule, "weight_decay", 0.0, math.inf, open_high=True)
    if rule.kind == "sgd":
        _number(name, rule, "momentum", 0.0, 1.0, open_high=True)
    else:
        _number(name, rule, "beta1", 0.0, 1.0, open_high=True)
        _number(name, rule, "beta2", 0.0, 1.0, open_high=True)
        _number(name, rule, "eps", 0.0, math.inf, open_high=True)
        if rule.eps <= 0:
            raise RequestError(ErrorCode.BAD_REQUEST, f"{name!r}: rule adam needs eps > 0")


@dataclass(frozen=True, slots=True)
class State:
    """What a rule keeps between steps (torch.optim's per-parameter state).

    Attributes:
        step: steps taken.
        momentum: sgd's momentum buffer, or adam's first moment ``m``.
        variance: adam's second moment ``v``.
    """

    step: int = 0
    momentum: np.ndarray | None = None
    variance: np.ndarray | None = None


_all = np.logical_and.reduce

# The compiled folds (see _cfold.pyx), unless the pure path is asked for or not built.
_cfold = compiled("values._cfold")
# A compiled fold of fewer bytes than this runs in one part (see parallel.in_parts).
_SPLIT_BYTES = 2 * PART_BYTES
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


def _compiled_dtype(a: np.ndarray) -> bool:
    """True if ``a`` is a C-contiguous array of a dtype the compiled folds take."""
    dtype = a.dtype
    return (dtype is _F32 or dtype is _F64) and a.flags.c_contiguous


def _working_dtype(dtype: np.dtype) -> np.dtype:
    # Integers (``sum`` only) are added in their own type: exactly, wrapping
    # around on overflow as torch's integer tensors do. float64 stays float64;
    # every narrower float is computed in float32 (bfloat16 and float16 as
    # torch computes them on the CPU).
    if dtype.kind in "iu":
        return dtype
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def fold(rule: Any, w: np.ndarray, g: np.ndarray, state: State | None) -> tuple[np.ndarray, State]:
    """Fold the gradient ``g`` into ``w`` by ``rule``; answer the new value and state.

    ``w`` and ``state`` are not changed: the answers are new arrays. ``g``
    has ``w``'s shape (the caller checks); the new value has ``w``'s dtype.

    torch.optim's arithmetic, in as few passes over memory as it allows: the
    step ``w - lr * d`` is made as ``(d * -lr) + w``, the same bits (a float's
    negation is exact, and so is subtracting ``b`` as adding ``-b``), into one
    new array and no other.
    """
    with np.errstate(all="ignore"):  # an overflow gives inf, as torch does
        return fold_into(rule, w, g, state)


def fold_into(
    rule: Any,
    w: np.ndarray,
    g: np.ndarray,
    state: State | None,
    *,
    check: str | None = None,
) -> tuple[np.ndarray, State]:
    """:func:`fold`, for a caller that holds ``np.errstate(all="ignore")`` already (the
    store, around a push's gradients: entering it costs as much as a small fold).

    ``check``: the gradient's name, to :func:`check_finite` it first (as ``"gradient
    'name'"``). A compiled fold checks it in the same call, one loop before its own.

    Raises:
        RequestError: (with ``check``) ``g`` holds NaN or inf, and ``rule`` refuses them.
    """
    state = state or State()
    if _cfold is not None and g.dtype is w.dtype and _compiled_dtype(w) and _compiled_dtype(g):
        finite = check is None or rule.allow_nonfinite
        made = _fold_compiled(rule, w, g, state, not finite)
        if made is None:
            check_finite(f"gradient {check!r}", g, rule)  # (raises, saying how many)
            raise AssertionError("the fold and check_finite disagree")  # pragma: no cover
        return made
    if check is not None:
        check_finite(f"gradient {check!r}", g, rule)
    return _fold_numpy(rule, w, g, state)


def _fold_numpy(rule: Any, w: np.ndarray, g: np.ndarray, state: State) -> tuple[np.ndarray, State]:
    """:func:`fold_into` with numpy: every dtype, any layout."""
    if w.ndim == 0:  # (numpy's arithmetic answers 0-d arrays with scalars: one element)
        x, new = _fold_numpy(rule, w.reshape(1), g.reshape(1), _reshaped(state, (1,)))
        return x.reshape(()), _reshaped(new, ())
    work = _working_dtype(w.dtype)
    grad = g.astype(work, copy=False)
    kind = rule.kind
    if kind == "sum":
        x = np.add(w, grad, dtype=work)
        new = State(state.step + 1)
    elif kind == "sgd":
        if rule.weight_decay:
            grad = grad + rule.weight_decay * w.astype(work, copy=False)
        if rule.momentum:
            if state.momentum is None:
                buf = np.array(grad, dtype=work)
            else:
                buf = rule.momentum * state.momentum + grad
            x = _stepped(w, buf, rule.lr, work)
            new = State(state.step + 1, buf)
        else:
            x = _stepped(w, grad, rule.lr, work)
            new = State(state.step + 1)
    elif kind == "adam":
        if rule.weight_decay:
            grad = grad + rule.weight_decay * w.astype(work, copy=False)
        b1, b2 = rule.beta1, rule.beta2
        m = state.momentum if state.momentum is not None else np.zeros_like(grad)
        v = state.variance if state.variance is not None else np.zeros_like(grad)
        m = b1 * m + (1 - b1) * grad
        v = b2 * v + (1 - b2) * (grad * grad)
        step = state.step + 1
        bias1 = 1 - b1**step
        bias2 = 1 - b2**step
        denom = np.sqrt(v)
        denom /= math.sqrt(bias2)
        denom += rule.eps
        update = np.divide(m, denom, out=denom)  # (denom is ours: reused)
        x = _stepped(w, update, rule.lr / bias1, work)
        new = State(step, m, v)
    else:  # check_rule keeps other kinds out
        raise RequestError(ErrorCode.BAD_REQUEST, f"unknown rule {kind!r}")
    return x.astype(w.dtype, copy=False), new


def _reshaped(state: State, shape: tuple[int, ...]) -> State:
    m, v = state.momentum, state.variance
    return State(
        state.step, None if m is None else m.reshape(shape), None if v is None else v.reshape(shape)
    )


def _fold_compiled(
    rule: Any, w: np.ndarray, g: np.ndarray, state: State, check: bool = False
) -> tuple[np.ndarray, State] | None:
    """:func:`fold_into` by the compiled folds: ``w`` and ``g`` are C-contiguous, of one
    dtype, float32 or float64 (the caller checks). The rules' scalars are computed here
    as numpy's path computes them (in Python's floats), and converted there. A large
    fold runs in parts on several cores (:mod:`.parallel`): the same bits.

    With ``check``: None if ``g`` holds NaN or inf (the new arrays are left unused)."""
    c = _cfold
    assert c is not None  # (the caller checks)
    out = empty_like(w)
    kind = rule.kind
    decay = rule.weight_decay or 0.0
    small = w.nbytes < _SPLIT_BYTES  # (one call as it is: the common case, kept cheap)
    if kind == "sum":
        if not (c.add if small else _in_parts(c.add))(w, g, out, check):
            return None
        return out, _stepped_state(state.step + 1)
    if kind == "sgd":
        fold_sgd = c.sgd if small else _in_parts(c.sgd)
        if not rule.momentum:
            if not fold_sgd(w, g, out, None, None, -rule.lr, decay, 0.0, check):
                return None
            return out, _stepped_state(state.step + 1)
        buf = empty_like(w)
        if not fold_sgd(w, g, out, buf, state.momentum, -rule.lr, decay, rule.momentum, check):
            return None
        return out, State(state.step + 1, buf)
    if kind == "adam":
        b1, b2 = rule.beta1, rule.beta2
        step = state.step + 1
        m, v = empty_like(w), empty_like(w)
        neg_lr = -(rule.lr / (1 - b1**step))
        scalars = (neg_lr, decay, b1, b2, math.sqrt(1 - b2**step), rule.eps)
        fold_adam = c.adam if small else _in_parts(c.adam)
        if not fold_adam(w, g, out, m, v, state.momentum, state.variance, *scalars, check):
            return None
        return out, State(step, m, v)
    raise RequestError(ErrorCode.BAD_REQUEST, f"unknown rule {kind!r}")  # (see fold_into)


def _in_parts(fold: Any) -> Any:
    """``fold``, called in parts of its first array (each array's same elements)."""

    def run(w: np.ndarray, *args: Any) -> bool:
        flat = [_flat(a) for a in (w, *args)]
        return all(in_parts(lambda p: fold(*[_part(a, p) for a in flat]), w.size, w.itemsize))

    return run


def fold_entries(
    grads: Sequence[Any],
    entries: dict[str, Any],
    states: dict[str, State],
    origin: str,
    *,
    entry: Any,
    max_version: int,
    max_name_bytes: int,
) -> tuple[dict[str, Any], dict[str, State], list[int]] | None:
    """A push's fold of every gradient of the common case (a stored parameter's, named
    once, small, raw, float32 or float64, its parameter's dtype and shape, finite where
    its rule asks), compiled whole: the new entries by name (made by ``entry``, the
    store's class), their states by name, and the indices of the gradients not taken
    (for the caller to check and fold its own way). None: no compiled folds here. The
    same bits as :func:`fold_into` (see ``_cfold.fold_entries``)."""
    if _cfold is None or _BIG_ENDIAN:
        return None
    listed = grads if type(grads) is list else list(grads)
    made: tuple[dict[str, Any], dict[str, State], list[int]] = _cfold.fold_entries(
        listed, entries, states, origin, max_version, max_name_bytes, _SPLIT_BYTES, entry,
        _stepped_state, State,
    )  # fmt: skip
    return made


_BIG_ENDIAN = sys.byteorder != "little"  # (the compiled lane takes "<f4" and "<f8")


def _stepped_state(step: int) -> State:
    """``State(step)``: of a rule that keeps nothing else, one object for each step count
    (a State is never changed; making one costs as much as a small fold's arithmetic)."""
    made = _PLAIN_STATES.get(step)
    if made is None:
        if len(_PLAIN_STATES) >= MAX_PLAIN_STATES:
            _PLAIN_STATES.clear()
        made = _PLAIN_STATES[step] = State(step)
    return made


# The States of _stepped_state, by step: the parameters of a model step together, so
# the steps there are at once are few (bounded: cleared when full).
MAX_PLAIN_STATES = 64
_PLAIN_STATES: dict[int, State] = {}


def _flat(a: Any) -> Any:
    """An array (C-contiguous) as one dimension, a view; anything else as it is."""
    return a.reshape(-1) if isinstance(a, np.ndarray) and a.ndim != 1 else a


def _part(a: Any, part: slice) -> Any:
    return a[part] if isinstance(a, np.ndarray) else a


def _stepped(w: np.ndarray, d: np.ndarray, lr: float, work: np.dtype) -> np.ndarray:
    """``w - lr * d`` in ``work``, as a new array: ``(d * -lr) + w`` (see :func:`fold`)."""
    x = np.multiply(d, -lr, dtype=work)
    x += w
    return x
