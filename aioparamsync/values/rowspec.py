"""What an embedding table is: its initializer, its fold rule and its spec (plain values).

:class:`Init` makes a row on first touch, a pure function of (table, seed,
id): a counter-based hash (splitmix64), not a random stream, so every
replica and every restart makes the same row, whichever other rows exist and
in whatever order they were touched. :class:`RowRule` is how a row's
gradient folds (sgd, adagrad, lazy adam: see :mod:`.rows`). :class:`BlockSpec`
is the two with the name, width and dtype. Each is a frozen dataclass of
plain values, checked when made (a :class:`RequestError` names the field).
"""

from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Self

import numpy as np

from ..errors import ErrorCode, RequestError
from ..placement import mix64

__all__ = [
    "DTYPES",
    "INIT_KINDS",
    "RULE_KINDS",
    "STATE",
    "BlockSpec",
    "Init",
    "RowRule",
    "check_steps",
    "check_time",
    "check_times",
    "normal",
    "uniform",
    "zeros",
]

INIT_KINDS = ("zeros", "uniform", "normal")
RULE_KINDS = ("sgd", "adagrad", "adam")
DTYPES = ("float32", "float64", "float16", "bfloat16")
# The state each rule keeps per row, named as torch.optim names it.
STATE = {"sgd": (), "adagrad": ("sum",), "adam": ("exp_avg", "exp_avg_sq", "step")}
# Widest row a table may have.
MAX_DIM = 1 << 20
# Elements made at once by an initializer: its temporaries stay in the cache (4x faster
# than 2**22 at a time, measured).
INIT_CHUNK = 1 << 16

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment
_S11 = np.uint64(11)
_TWO_TO_MINUS_53 = 2.0**-53


def _bad(message: str, code: ErrorCode = ErrorCode.BAD_REQUEST) -> RequestError:
    return RequestError(code, message)


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _check_number(where: str, name: str, value: Any, need: str, ok: Any) -> None:
    if not (_real(value) and ok(value)):
        raise _bad(f"{where}: {name} must be {need}, not {value!r}")


class _Plain:
    """A frozen dataclass that goes on the wire and into snapshots as a dict of plain values."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (nested specs as dicts too)."""
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """The object of :meth:`to_dict`'s dict; raises RequestError if it is not one."""
        return cls(**_known(cls, data))


def _known(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    unknown = set(data) - set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    if unknown:
        raise _bad(f"{cls.__name__}: unknown field(s) {', '.join(sorted(unknown))}")
    return dict(data)


# -- initializers ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Init(_Plain):
    """How a table makes a row on first touch: ``zeros``, ``uniform`` or ``normal``.

    Attributes:
        kind: one of :data:`INIT_KINDS`.
        scale: ``a`` of U(-a, a), or the standard deviation of N(0, scale^2).
        seed: mixed into every value, in [0, 2**64).
    """

    kind: str = "zeros"
    scale: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in INIT_KINDS:
            raise _bad(f"init: kind must be one of {', '.join(INIT_KINDS)}, not {self.kind!r}")
        _check_number("init", "scale", self.scale, "a finite number >= 0", lambda x: x >= 0)
        seed = self.seed
        if not (isinstance(seed, numbers.Integral) and not isinstance(seed, bool)):
            raise _bad(f"init: seed must be an integer, not {seed!r}")
        if not 0 <= int(seed) < 1 << 64:
            raise _bad(f"init: seed must be in [0, 2**64), not {seed!r}")

    def values(self, table: str, ids: np.ndarray, dim: int, dtype: Any = np.float32) -> np.ndarray:
        """The initial rows of ``ids`` in table ``table``: an ``(len(ids), dim)`` array."""
        out = np.empty((len(ids), dim), dtype)
        self.fill(out, table, np.asarray(ids, np.int64))
        return out

    def fill(self, out: np.ndarray, table: str, ids: np.ndarray) -> None:
        """Write the initial rows of ``ids`` (int64) into ``out`` (``(len(ids), dim)``)."""
        if self.kind == "zeros" or self.scale == 0:
            out[...] = 0
            return
        dim = out.shape[1]
        half = (dim + 1) // 2
        key = _table_key(table, int(self.seed))
        step = max(1, INIT_CHUNK // dim)
        for start in range(0, len(ids), step):
            chunk = ids[start : start + step].view(np.uint64)
            streams = mix64(chunk ^ key)  # distinct ids, distinct streams (mix64 is a bijection)
            rows = out[start : start + step]
            if self.kind == "uniform":
                u = _uniforms(streams, 0, dim)
                u *= 2.0 * self.scale
                u -= self.scale
                rows[...] = u
                continue
            # Box-Muller: draws j and half+j make elements j (r cos) and half+j (r sin);
            # sin is had from cos (sqrt rounds exactly; float64 np.cos is the costly part).
            radius = np.log1p(-_uniforms(streams, 0, half))  # log(1-u), 1-u in (0, 1]
            radius *= -2.0
            np.sqrt(radius, out=radius)
            radius *= self.scale
            angle = _uniforms(streams, half, half)
            angle *= 2.0 * math.pi
            cos = np.cos(angle)
            sin = np.sqrt(np.maximum(0.0, 1.0 - cos * cos))
            np.copysign(sin, math.pi - angle, out=sin)  # negative on the lower half circle
            cos *= radius
            sin *= radius
            rows[:, :half] = cos
            rows[:, half:] = sin[:, : dim - half]


def _uniforms(streams: np.ndarray, first: int, count: int) -> np.ndarray:
    # Draws first+1 .. first+count of each row's splitmix64 stream, as uniforms in
    # [0, 1) of 53 bits (float64): an (len(streams), count) array.
    counters = np.arange(first + 1, first + count + 1, dtype=np.uint64) * _GOLDEN
    bits = mix64(streams[:, None] + counters)
    bits >>= _S11
    u = bits.astype(np.float64)
    u *= _TWO_TO_MINUS_53
    return u


def _table_key(table: str, seed: int) -> np.uint64:
    # A stable 64-bit key per (table, seed): blake2b of the name, not hash() (salted).
    name = int.from_bytes(hashlib.blake2b(table.encode(), digest_size=8).digest(), "little")
    mixed_seed = mix64(np.array([seed], np.uint64) + _GOLDEN)
    return mix64(mixed_seed ^ np.uint64(name))[0]


def zeros() -> Init:
    """Rows start at 0."""
    return Init("zeros")


def uniform(a: float, *, seed: int = 0) -> Init:
    """Rows start with each element drawn from U(-a, a)."""
    return Init("uniform", a, seed)


def normal(std: float, *, seed: int = 0) -> Init:
    """Rows start with each element drawn from N(0, std^2)."""
    return Init("normal", std, seed)


# -- rules ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RowRule(_Plain):
    """How a table folds a row's gradient into it (see the module's docstring).

    Attributes:
        kind: one of :data:`RULE_KINDS`.
        lr: learning rate, finite and > 0.
        eps: adagrad's and adam's epsilon, > 0.
        beta1, beta2: adam's betas, in [0, 1).
        initial_accumulator: adagrad's initial ``s``, finite and >= 0.
        allow_nonfinite: fold gradients holding NaN or inf (by default refused),
            and so keep rows that hold them.
    """

    kind: str = "sgd"
    lr: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    initial_accumulator: float = 0.0
    allow_nonfinite: bool = False

    def __post_init__(self) -> None:
        if self.kind not in RULE_KINDS:
            raise _bad(f"rule: kind must be one of {', '.join(RULE_KINDS)}, not {self.kind!r}")
        for name, need, ok in _RULE_FIELDS:
            _check_number("rule", name, getattr(self, name), need, ok)
        if not isinstance(self.allow_nonfinite, bool):
            raise _bad(f"rule: allow_nonfinite is True or False, not {self.allow_nonfinite!r}")

    @classmethod
    def of(cls, rule: Any) -> RowRule:
        """The row rule of the IDL's ``Rule`` (what :func:`aioparamsync.sgd`, ``adagrad``
        and ``adam`` make, the one set of rule constructors): sgd, adagrad or adam,
        without momentum or weight decay; adagrad's eps is torch's (1e-10) unless given.

        Raises:
            RequestError: (BAD_REQUEST) another kind, or momentum or weight decay.
        """
        kind = rule.kind
        if kind not in ("sgd", "adagrad", "adam"):
            raise _bad(f"rows fold by sgd, adagrad or adam, not {kind!r}")
        if rule.momentum or rule.weight_decay:
            raise _bad(f"rule {kind} of rows takes lr, eps and betas, no momentum or weight_decay")
        given = {
            f: getattr(rule, f)
            for f in ("lr", "eps", "beta1", "beta2", "initial_accumulator", "allow_nonfinite")
            if getattr(rule, f) is not None
        }
        if kind == "adagrad" and "eps" not in given:
            given["eps"] = 1e-10
        return cls(kind, **given)

    @property
    def state_names(self) -> tuple[str, ...]:
        """The per-row state the rule keeps (torch.optim's names): ``()``, ``("sum",)``..."""
        return STATE[self.kind]


_RULE_FIELDS = (
    ("lr", "a finite number > 0", lambda x: x > 0),
    ("eps", "a finite number > 0", lambda x: x > 0),
    ("beta1", "in [0, 1)", lambda x: 0 <= x < 1),
    ("beta2", "in [0, 1)", lambda x: 0 <= x < 1),
    ("initial_accumulator", "a finite number >= 0", lambda x: x >= 0),
)


# -- tables ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlockSpec(_Plain):
    """What an embedding table is: name, row width, storage dtype, initializer, rule.

    Attributes:
        name: the table's name (also keys its initial rows).
        dim: the row width, in [1, MAX_DIM].
        dtype: the rows' dtype, one of :data:`DTYPES`.
        init: how rows start.
        rule: how gradients fold into rows.
    """

    name: str
    dim: int
    dtype: str = "float32"
    init: Init = field(default_factory=Init)
    rule: RowRule = field(default_factory=RowRule)

    def __post_init__(self) -> None:
        if not (isinstance(self.name, str) and self.name):
            raise _bad(f"table: name must be a non-empty string, not {self.name!r}")
        dim = self.dim
        if not (isinstance(dim, numbers.Integral) and not isinstance(dim, bool)):
            raise _bad(f"table {self.name!r}: dim must be an integer, not {dim!r}")
        if not 1 <= dim <= MAX_DIM:
            raise _bad(f"table {self.name!r}: dim must be in [1, {MAX_DIM}], not {dim}")
        if self.dtype not in DTYPES:
            raise _bad(f"table {self.name!r}: dtype must be one of {', '.join(DTYPES)}")
        if not isinstance(self.init, Init) or not isinstance(self.rule, RowRule):
            raise _bad(f"table {self.name!r}: init must be an Init and rule a RowRule")

    @property
    def np_dtype(self) -> np.dtype:
        """The rows' numpy dtype (ml_dtypes' bfloat16 for ``"bfloat16"``, imported then)."""
        if self.dtype == "bfloat16":
            import ml_dtypes  # a core dependency; imported only by the tables that use it

            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(self.dtype)

    @property
    def work_dtype(self) -> np.dtype:
        """The dtype folds are computed (and rule state kept) in: float64 or float32."""
        return np.dtype(np.float64 if self.dtype == "float64" else np.float32)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """The spec of :meth:`to_dict`'s dict (init and rule as dicts too)."""
        fields = _known(cls, data)
        fields["init"] = Init.from_dict(fields.get("init", {}))
        fields["rule"] = RowRule.from_dict(fields.get("rule", {}))
        return cls(**fields)


def check_steps(steps: Any, n: int, what: str = "step") -> np.ndarray:
    """``steps`` (counts: a row's versions, Adam's steps) as ``n`` int64, or refused."""
    steps = np.asarray(steps)
    if steps.dtype.kind not in "iu" or steps.shape != (n,):
        raise _bad(
            f"{what} must be {n} integers, not {steps.dtype} of shape {steps.shape}",
            ErrorCode.SHAPE_MISMATCH,
        )
    if (steps < 0).any():
        raise _bad(f"{what}: a count cannot be negative")
    return steps.astype(np.int64, copy=False)


def check_time(what: str, value: Any) -> float:
    """``value`` (a time, in seconds) as a float, or refused: it is a finite number."""
    if not _real(value):
        raise _bad(f"{what} must be a finite number, not {value!r}")
    return float(value)


def check_times(times: Any, n: int) -> np.ndarray:
    """``times`` (each row's last touch) as ``n`` finite float64, or refused."""
    times = np.asarray(times)
    if times.dtype.kind not in "iuf" or times.shape != (n,) or not np.isfinite(times).all():
        raise _bad(f"touched must be {n} finite times, not {times.dtype} of shape {times.shape}")
    return times.astype(np.float64)
