"""numpy arrays <-> ``Parameter``: dtype and shape on the wire, no needless copies.

A parameter's ``data`` is the array's bytes in C order, ``dtype`` numpy's
dtype string (``arr.dtype.str``, e.g. ``"<f4"``) and ``shape`` its shape. A
parameter without a dtype is plain bytes (what a founding client sends).

Sending takes the array's buffer by reference (a non-contiguous array is made
contiguous first: the one copy that cannot be avoided). Receiving answers a
read-only array over the received bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, cast

import numpy as np

from .errors import ErrorCode, RequestError
from .wire import thrift

__all__ = ["check_layout", "from_parameter", "to_parameter"]

# numpy kinds a parameter may hold: bool, signed, unsigned, float, complex.
NUMERIC_KINDS = frozenset("biufc")
# Most dimensions a parameter may have (numpy's own limit).
MAX_DIMS = 64


def _dtype(dtype: str) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except Exception:  # noqa: BLE001 - numpy raises SyntaxError, warnings... on odd strings
        raise RequestError(ErrorCode.SHAPE_MISMATCH, f"{dtype!r} is not a numpy dtype") from None
    if dt.kind not in NUMERIC_KINDS or dt.fields is not None or dt.subdtype is not None:
        raise RequestError(ErrorCode.SHAPE_MISMATCH, f"dtype {dtype!r} is not a numeric dtype")
    return dt


def check_layout(name: str, nbytes: int, dtype: str | None, shape: Sequence[int] | None) -> None:
    """Check that ``nbytes`` of data fit ``dtype`` and ``shape``.

    Raises:
        RequestError: (SHAPE_MISMATCH) they do not, or the dtype is not numeric.
    """
    if shape is not None and len(shape) > MAX_DIMS:
        raise RequestError(
            ErrorCode.SHAPE_MISMATCH, f"{name!r}: {len(shape)} dimensions; at most {MAX_DIMS}"
        )
    if shape is not None and any(d < 0 for d in shape):
        raise RequestError(
            ErrorCode.SHAPE_MISMATCH, f"{name!r}: negative dimension in {tuple(shape)}"
        )
    if dtype is None:
        if shape is not None and math.prod(shape) != nbytes:
            raise RequestError(
                ErrorCode.SHAPE_MISMATCH,
                f"{name!r}: shape {tuple(shape)} without a dtype needs "
                f"{math.prod(shape)} bytes, got {nbytes}",
            )
        return
    dt = _dtype(dtype)
    if shape is None:
        if nbytes % dt.itemsize:
            raise RequestError(
                ErrorCode.SHAPE_MISMATCH,
                f"{name!r}: {nbytes} bytes is not a whole number of {dtype} items",
            )
        return
    expected = math.prod(shape) * dt.itemsize
    if expected != nbytes:
        raise RequestError(
            ErrorCode.SHAPE_MISMATCH,
            f"{name!r}: shape {tuple(shape)} of {dtype} needs {expected} bytes, got {nbytes}",
        )


def to_parameter(name: str, array: Any, version: int = 0) -> Any:
    """Make a ``Parameter`` of an array (anything ``np.asarray`` takes).

    The array's memory is used as is: do not change it until the call that
    sends the parameter has returned.

    Args:
        name: the parameter's name.
        array: the values; any numeric dtype, any shape, contiguous or not.
        version: the version to ask for (0: the node picks stored + 1).

    Returns:
        A ``Parameter`` with ``data``, ``dtype`` and ``shape`` set.

    Raises:
        TypeError: the array is not numeric (object, strings, records...).
    """
    arr = np.asarray(array)
    if arr.dtype.kind not in NUMERIC_KINDS or arr.dtype.fields is not None:
        raise TypeError(f"{name!r}: cannot send an array of dtype {arr.dtype}")
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    data = memoryview(cast(Any, arr.reshape(-1).view(np.uint8)))
    return thrift.Parameter(
        name=name, data=data, version=version, dtype=arr.dtype.str, shape=list(arr.shape)
    )


def from_parameter(param: Any, dtype: Any = None) -> np.ndarray:
    """The array a ``Parameter`` holds, as a view of its bytes (read-only when they are).

    Args:
        param: a ``Parameter``.
        dtype: for a parameter sent without one (a founding client's plain
            bytes), the dtype to read it as; default ``uint8``.

    Raises:
        RequestError: (SHAPE_MISMATCH) the bytes do not fit the dtype and shape.
    """
    data = param.data
    nbytes = memoryview(data).nbytes
    stored = param.dtype if param.dtype is not None else (np.dtype(dtype or np.uint8).str)
    shape = param.shape if param.dtype is not None else None
    check_layout(param.name, nbytes, stored, shape)
    arr = np.frombuffer(data, dtype=np.dtype(stored))
    return arr.reshape(shape) if shape is not None else arr


def to_parameters(arrays: Any) -> list[Any]:
    """``Parameter`` objects of a mapping of name -> array, or of ``Parameter`` objects."""
    if hasattr(arrays, "items"):
        return [to_parameter(name, value) for name, value in arrays.items()]
    params = list(arrays) if isinstance(arrays, Iterable) else None
    if params is None or not all(isinstance(p, thrift.Parameter) for p in params):
        raise TypeError("expected a mapping of name -> array, or Parameter objects")
    return params
