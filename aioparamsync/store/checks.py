"""What an update or a gradient must be to be applied: layouts kept, casts without loss, rules.

The checks :class:`~aioparamsync.store.table.ParameterTable` makes of each
parameter before it changes anything; each raises ``RequestError`` and
changes nothing. Pure: numpy and the values layer, no asyncio.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ErrorCode, RequestError
from ..values import rules
from ..values.arrays import (
    BFLOAT16,
    describe_layout,
    dtype_name,
    from_parameter,
    layout,
    lossless_cast,
    parse_dtype,
    same_kind_cast,
)

if TYPE_CHECKING:
    from .table import Entry, Limits

__all__ = [
    "RESERVED_NAME",
    "cast_to",
    "check_cast",
    "check_count",
    "check_keeps_layout",
    "check_names",
    "check_rule_fits",
]

# The one name a parameter may not have: a safetensors file (a snapshot) keeps
# its own metadata under it.
RESERVED_NAME = "__metadata__"


def check_keeps_layout(
    current: Entry,
    nbytes: int,
    dtype: str | None,
    shape: Sequence[int] | None,
    *,
    lossy: bool = False,
) -> None:
    """Check that an update of ``current`` keeps its layout (it was not asked to replace it).

    Plain bytes keep the stored layout if they are its size; an array must
    have the stored dtype, and the stored shape or none (and the stored size).
    An array the caller sent in a lossy encoding (``lossy``: the node's
    decoder says so) may be of a wider dtype of the same kind: its values are
    cast to the stored one (see :meth:`ParameterTable.apply`).
    """
    if (
        dtype == current.dtype
        and nbytes == current.nbytes
        and (shape is None or tuple(shape) == current.shape)
    ):
        return  # the layout as it is stored (the common case: no dtype to parse)
    stored = current.nbytes, current.dtype, current.shape
    if dtype is None:
        if nbytes == current.nbytes:
            return
        raise RequestError(
            ErrorCode.SHAPE_MISMATCH,
            f"{current.name!r} is stored as {describe_layout(*stored)} ({current.nbytes} "
            f"bytes); an update of {nbytes} plain bytes does not fit it. Send "
            f"{current.nbytes} bytes, or replace the parameter (Parameter.replace)",
        )
    if shape is None and nbytes == current.nbytes:
        shape = current.shape or None  # no shape given: the stored one, if the size is its
    given, kept = layout(nbytes, dtype, shape), layout(*stored)
    if given == kept:
        return
    if lossy and given[1] == kept[1] and same_kind_cast(given[0], kept[0]):
        return  # precision the caller chose to lose: cast to the stored dtype
    raise RequestError(
        ErrorCode.SHAPE_MISMATCH,
        f"{current.name!r} is stored as {describe_layout(*stored)}; the update has "
        f"{describe_layout(nbytes, dtype, shape)}. An update keeps a parameter's dtype "
        "and shape: convert the array to the stored layout, or replace the parameter "
        "(replace=True; on the wire, Parameter.replace)",
    )


def cast_to(p: Any, current: Entry) -> Any:
    """The values of update ``p`` in ``current``'s dtype (and shape): its data, cast."""
    target = parse_dtype(current.dtype) if current.dtype is not None else None
    value = from_parameter(p)
    if value.dtype == target:
        return p.data  # the same dtype, spelt another way ("<f4", "float32")
    cast = value.astype(target).reshape(current.shape or -1)
    cast.flags.writeable = False  # ours alone: the entry keeps it, uncopied
    return cast.reshape(-1).view(np.uint8)


# The casts check_cast found allowed (a few pairs of numeric dtypes), bounded.
MAX_CASTS = 256
_CASTS: set[tuple[np.dtype, np.dtype, bool]] = set()


def check_cast(name: str, source: np.dtype, target: np.dtype, *, lossy: bool) -> None:
    """Check that a gradient of dtype ``source`` folds into a parameter of ``target``.

    Without loss only (numpy's "safe" casting: a float64 gradient does not
    fold into float32 weights, a float into integers, complex into reals);
    a gradient the caller sent in a lossy encoding may lose precision but
    not its kind ("same_kind": floats into narrower floats).
    """
    key = (source, target, lossy)
    if key in _CASTS:
        return
    if lossless_cast(source, target) or (lossy and same_kind_cast(source, target)):
        if len(_CASTS) < MAX_CASTS:
            _CASTS.add(key)
        return
    what, given = dtype_name(target), dtype_name(source)
    kind_lost = not same_kind_cast(source, target)
    raise RequestError(
        ErrorCode.SHAPE_MISMATCH,
        f"gradient {name!r} of {given} cannot fold into a parameter of {what} without "
        + (
            f"loss ({given} values are not {what} values): send it as {what}"
            if kind_lost
            else f"losing precision: send it as {what}, or ask for a lossy encoding "
            "(fp16, bf16, int8, topk)"
        ),
    )


def check_rule_fits(name: str, rule: Any, dtype: str | None) -> None:
    """Check a rule, and that it can fold gradients into an array of ``dtype``."""
    rules.check_rule(name, rule)
    # (check_layout has checked that dtype is a numeric one)
    kind = "f" if dtype == BFLOAT16 else np.dtype(dtype).kind if dtype else ""
    if kind not in ("iuf" if rule.kind == "sum" else "f") or not kind:
        raise RequestError(
            ErrorCode.BAD_REQUEST,
            f"{name!r}: rule {rule.kind} needs a "
            f"{'real' if rule.kind == 'sum' else 'floating point'} dtype, not {dtype}",
        )


def check_count(limits: Limits, count: int, *, what: str) -> None:
    """Refuse more than ``max_params_per_update`` parameters (or gradients) in one request."""
    if count > limits.max_params_per_update:
        raise RequestError(
            ErrorCode.LIMIT_EXCEEDED,
            f"{count} {what} in one request; the limit is {limits.max_params_per_update}",
        )


def check_names(limits: Limits, params: Sequence[Any], *, what: str) -> None:
    """Check the names of an update's (or a push's) ``params``: how many, each a name a
    parameter may have, none twice."""
    check_count(limits, len(params), what=what)
    seen: set[str] = set()
    for p in params:
        name = p.name
        if not isinstance(name, str) or not name:
            raise RequestError(ErrorCode.BAD_REQUEST, "a parameter name is empty")
        if name == RESERVED_NAME:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"{name!r} is reserved: snapshots are safetensors files, whose header "
                "keeps its own data under that name",
            )
        if len(name.encode()) > limits.max_name_bytes:
            raise RequestError(
                ErrorCode.LIMIT_EXCEEDED,
                f"a parameter name of {len(name.encode())} bytes is longer than "
                f"{limits.max_name_bytes}",
            )
        if name in seen:
            raise RequestError(ErrorCode.BAD_REQUEST, f"{name!r} appears twice in one update")
        seen.add(name)
