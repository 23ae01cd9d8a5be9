"""numpy arrays <-> ``Parameter``: dtype and shape on the wire, no needless copies.

A parameter's ``data`` is the array's bytes in C order, ``dtype`` numpy's
dtype string (``arr.dtype.str``, e.g. ``"<f4"``) and ``shape`` its shape. A
parameter without a dtype is plain bytes (what a founding client sends).

numpy has no bfloat16; the ``ml_dtypes`` package gives it one, whose dtype
string (``"<V2"``) says nothing. So a bfloat16 array goes on the wire as
``"bfloat16"``, its bytes little-endian. ``ml_dtypes`` is imported only when
that dtype is met, so importing this module stays light.

Sending takes the array's buffer by reference (a non-contiguous array is made
contiguous first: the one copy that cannot be avoided). Receiving answers a
read-only array over the received bytes.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Sequence
from typing import Any, cast

import numpy as np

from ..errors import ErrorCode, RequestError
from ..wire import thrift

__all__ = [
    "BFLOAT16",
    "array_of",
    "check_layout",
    "check_shape",
    "describe_layout",
    "dtype_name",
    "layout",
    "lossless_cast",
    "same_kind_cast",
    "from_parameter",
    "is_bfloat16",
    "parse_dtype",
    "to_parameter",
    "wire_dtype",
]

# numpy kinds a parameter may hold: bool, signed, unsigned, float, complex.
NUMERIC_KINDS = frozenset("biufc")
# Most dimensions a parameter may have (numpy's own limit).
MAX_DIMS = 64
_MAX_INTP = int(np.iinfo(np.intp).max)
# The wire's dtype string of ml_dtypes.bfloat16 (numpy's own, "<V2", is ambiguous).
BFLOAT16 = "bfloat16"
# bfloat16 bytes on the wire are little-endian; a big-endian host swaps them.
SWAP_BFLOAT16 = sys.byteorder != "little"


def _bfloat16() -> np.dtype:
    # Imported here, not at the top: most users never meet a bfloat16.
    try:
        import ml_dtypes
    except ImportError:  # a core dependency, but say so rather than fail obscurely
        raise RequestError(
            ErrorCode.SHAPE_MISMATCH, "dtype 'bfloat16' needs the ml_dtypes package"
        ) from None
    return np.dtype(ml_dtypes.bfloat16)


def is_bfloat16(dtype: Any) -> bool:
    """Whether ``dtype`` (a numpy dtype) is ml_dtypes' bfloat16.

    Never imports ml_dtypes: an array cannot have that dtype unless it was imported.
    """
    ml = sys.modules.get("ml_dtypes")
    return ml is not None and np.dtype(dtype) == np.dtype(ml.bfloat16)


def wire_dtype(dtype: Any) -> str:
    """The dtype string a parameter of this dtype carries on the wire.

    Args:
        dtype: a numpy dtype (or anything ``np.dtype`` takes).

    Returns:
        ``"bfloat16"`` for ml_dtypes' bfloat16, numpy's ``dtype.str`` otherwise.
    """
    dt = np.dtype(dtype)
    return BFLOAT16 if is_bfloat16(dt) else dt.str


def parse_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a wire dtype string, checked to be numeric.

    Args:
        dtype: numpy's dtype string (e.g. ``"<f4"``) or ``"bfloat16"``.

    Returns:
        The dtype (ml_dtypes' bfloat16 for ``"bfloat16"``, imported then).

    Raises:
        RequestError: (SHAPE_MISMATCH) not a numpy dtype, or not numeric.
    """
    if dtype == BFLOAT16:
        return _bfloat16()
    parsed = _PARSED.get(dtype)
    if parsed is not None:
        return parsed
    try:
        dt = np.dtype(dtype)
    except Exception:  # noqa: BLE001 - numpy raises SyntaxError, warnings... on odd strings
        raise RequestError(ErrorCode.SHAPE_MISMATCH, f"{dtype!r} is not a numpy dtype") from None
    # ml_dtypes' types are kind "V": only the exact string "bfloat16" names one.
    if dt.kind not in NUMERIC_KINDS or dt.fields is not None or dt.subdtype is not None:
        raise RequestError(ErrorCode.SHAPE_MISMATCH, f"dtype {dtype!r} is not a numeric dtype")
    if len(_PARSED) < MAX_PARSED:  # (numeric dtype strings are few: "<f4", "float32", ...)
        _PARSED[dtype] = dt
    return dt


# The numeric dtypes parsed, by their string (np.dtype of a string takes a microsecond,
# a gradient a fraction of one): as many as there are ways to write them, bounded.
MAX_PARSED = 256
_PARSED: dict[str, np.dtype] = {}


def check_shape(name: str, shape: Sequence[int]) -> None:
    """Check that ``shape`` is one a parameter may have.

    Raises:
        RequestError: (SHAPE_MISMATCH) too many dimensions, or a negative one.
    """
    if len(shape) > MAX_DIMS:
        raise RequestError(
            ErrorCode.SHAPE_MISMATCH, f"{name!r}: {len(shape)} dimensions; at most {MAX_DIMS}"
        )
    if shape and min(shape) < 0:
        raise RequestError(
            ErrorCode.SHAPE_MISMATCH, f"{name!r}: negative dimension in {tuple(shape)}"
        )
    # (A zero dimension makes the size 0 whatever the others are, so no size
    # limit catches a huge one; numpy refuses any array whose other dimensions'
    # product, in bytes, passes its index type.)
    size = math.prod(shape) or math.prod(d for d in shape if d)
    if size * 16 > _MAX_INTP:
        raise RequestError(
            ErrorCode.SHAPE_MISMATCH, f"{name!r}: the shape {tuple(shape)} is too large for numpy"
        )


def check_layout(
    name: str, nbytes: int, dtype: str | None, shape: Sequence[int] | None
) -> np.dtype | None:
    """Check that ``nbytes`` of data fit ``dtype`` and ``shape``; answer the parsed dtype.

    Raises:
        RequestError: (SHAPE_MISMATCH) they do not, or the dtype is not numeric.
    """
    if shape is not None:
        check_shape(name, shape)
    if dtype is None:
        if shape is not None and math.prod(shape) != nbytes:
            raise RequestError(
                ErrorCode.SHAPE_MISMATCH,
                f"{name!r}: shape {tuple(shape)} without a dtype needs "
                f"{math.prod(shape)} bytes, got {nbytes}",
            )
        return None
    dt = parse_dtype(dtype)
    if shape is None:
        if nbytes % dt.itemsize:
            raise RequestError(
                ErrorCode.SHAPE_MISMATCH,
                f"{name!r}: {nbytes} bytes is not a whole number of {dtype} items",
            )
        return dt
    expected = math.prod(shape) * dt.itemsize
    if expected != nbytes:
        raise RequestError(
            ErrorCode.SHAPE_MISMATCH,
            f"{name!r}: shape {tuple(shape)} of {dtype} needs {expected} bytes, got {nbytes}",
        )
    return dt


def layout(nbytes: int, dtype: str | None, shape: Sequence[int] | None) -> Any:
    """What a parameter's bytes are, normalised: ``(np.dtype, shape)``, or None for plain bytes.

    A dtype without a shape is one dimension (the IDL's rule), so ``("<f4",
    None)`` of 12 bytes and ``("float32", [3])`` are the same layout. The
    parameter must have passed :func:`check_layout`.
    """
    if dtype is None:
        return None
    dt = parse_dtype(dtype)
    return dt, (tuple(shape) if shape is not None else (nbytes // dt.itemsize,))


def describe_layout(nbytes: int, dtype: str | None, shape: Sequence[int] | None) -> str:
    """A layout as people read it: ``"float32 (4, 3)"``, or ``"48 plain bytes"``."""
    made = layout(nbytes, dtype, shape)
    if made is None:
        return f"{nbytes} plain bytes"
    dt, dims = made
    return f"{dtype_name(dt)} {dims}"


def dtype_name(dtype: np.dtype) -> str:
    """A dtype as people read it: ``"float32"``, ``"bfloat16"``, ``">f4"`` (not native)."""
    if is_bfloat16(dtype):
        return BFLOAT16
    return dtype.name if dtype.isnative or dtype.byteorder == "|" else dtype.str


# What bfloat16 (8 significant bits, float32's range) holds exactly, and what holds it.
_INTO_BFLOAT16 = frozenset("?bB")
_FROM_BFLOAT16 = frozenset("fdgFDG")


def lossless_cast(source: np.dtype, target: np.dtype) -> bool:
    """Whether every value of ``source`` is a value of ``target`` (numpy's "safe" casting).

    Integers into floats wide enough, floats into wider floats, reals into
    complex; never floats into integers, complex into reals, or wider into
    narrower. bfloat16 counts as a float of 8 significant bits.
    """
    if source == target:
        return True
    if is_bfloat16(target):
        return source.char in _INTO_BFLOAT16
    if is_bfloat16(source):
        return target.char in _FROM_BFLOAT16 and target.byteorder in "=<|"
    return bool(np.can_cast(source, target, "safe"))


def same_kind_cast(source: np.dtype, target: np.dtype) -> bool:
    """Whether ``source`` may be cast to ``target`` keeping its kind (numpy's "same_kind").

    Floats may become narrower floats, but never integers; complex never real.
    bfloat16 counts as a float.
    """
    f4 = np.dtype(np.float32)
    return bool(
        np.can_cast(
            f4 if is_bfloat16(source) else source,
            f4 if is_bfloat16(target) else target,
            "same_kind",
        )
    )


def to_parameter(name: str, array: Any, version: int = 0) -> Any:
    """Make a ``Parameter`` of an array (anything ``np.asarray`` takes).

    The array's memory is used as is: do not change it until the call that
    sends the parameter has returned.

    Args:
        name: the parameter's name.
        array: the values; any numeric dtype (ml_dtypes' bfloat16 too), any
            shape, contiguous or not.
        version: the version to ask for (0: the node picks stored + 1).

    Returns:
        A ``Parameter`` with ``data``, ``dtype`` and ``shape`` set.

    Raises:
        TypeError: the array is not numeric (object, strings, records...).
    """
    if type(array) is np.ndarray and array.flags.c_contiguous and array.size:
        # (the common case, at once: its dtype was sent before, see _SENT)
        wire = _SENT.get(array.dtype)
        if wire is not None:
            data = memoryview(cast(Any, array)).cast("B")
            return thrift.Parameter(
                name=name, data=data, version=version, dtype=wire, shape=list(array.shape)
            )
    arr = np.asarray(array)
    bfloat16 = is_bfloat16(arr.dtype)
    if not bfloat16 and (arr.dtype.kind not in NUMERIC_KINDS or arr.dtype.fields is not None):
        raise TypeError(f"{name!r}: cannot send an array of dtype {arr.dtype}")
    if bfloat16 and SWAP_BFLOAT16:
        arr = arr.view(np.uint16).byteswap().view(arr.dtype)  # a copy, little-endian
    elif not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    data = memoryview(cast(Any, arr.reshape(-1).view(np.uint8)))
    dtype = BFLOAT16 if bfloat16 else arr.dtype.str
    if not bfloat16 and len(_SENT) < MAX_PARSED:
        _SENT[arr.dtype] = dtype  # (numeric, sent as its bytes are)
    return thrift.Parameter(
        name=name, data=data, version=version, dtype=dtype, shape=list(arr.shape)
    )


# The dtypes to_parameter has sent, each numeric and not bfloat16, with their wire string:
# an array of one is sent as its bytes are, without the checks (bounded as _PARSED).
_SENT: dict[np.dtype, str] = {}


def from_parameter(param: Any, dtype: Any = None) -> np.ndarray:
    """The array a ``Parameter`` holds, as a view of its bytes (read-only when they are).

    The data is read as it is: an encoded parameter (``encoding`` set) needs
    :func:`aioparamsync.values.compression.decode` instead.

    Args:
        param: a ``Parameter``.
        dtype: for a parameter sent without one (a founding client's plain
            bytes), the dtype to read it as; default ``uint8``.

    Returns:
        The array, of the parameter's dtype (``"bfloat16"``: ml_dtypes'
        bfloat16) and shape. On a big-endian host a bfloat16 array is a
        byte-swapped copy, not a view.

    Raises:
        RequestError: (SHAPE_MISMATCH) the bytes do not fit the dtype and shape.
    """
    data = param.data
    shape = param.shape
    dt = _PARSED.get(param.dtype)  # (None for None, "bfloat16" and a string not seen yet)
    if dt is not None and type(shape) is list and len(shape) == 1:
        # (the common case, at once: a vector of a dtype parsed before, its bytes a
        # whole number of elements, as many as its shape says)
        n = shape[0]
        if type(n) is int and n * dt.itemsize == memoryview(data).nbytes:  # (so n >= 0)
            return np.frombuffer(data, dtype=dt)
    nbytes = memoryview(data).nbytes
    stored = param.dtype if param.dtype is not None else wire_dtype(dtype or np.uint8)
    shape = shape if param.dtype is not None else None
    dt = check_layout(param.name, nbytes, stored, shape)
    assert dt is not None  # (stored is a dtype)
    arr = np.frombuffer(data, dtype=dt)
    if SWAP_BFLOAT16 and stored == BFLOAT16:
        arr = arr.view(np.uint16).byteswap().view(dt)
    return arr.reshape(shape) if shape is not None else arr


def array_of(param: Any) -> np.ndarray:
    """The array of a received ``Parameter``: :func:`from_parameter`'s, or decoded where
    it is encoded (see :func:`aioparamsync.values.compression.decode`)."""
    if not param.encoding:
        return from_parameter(param)
    from .compression import decode  # (not imported for raw data)

    return decode(param)


def to_parameters(arrays: Any) -> list[Any]:
    """``Parameter`` objects of a mapping of name -> array, or of ``Parameter`` objects."""
    if hasattr(arrays, "items"):
        return [to_parameter(name, value) for name, value in arrays.items()]
    params = list(arrays) if isinstance(arrays, Iterable) else None
    if params is None or not all(isinstance(p, thrift.Parameter) for p in params):
        raise TypeError("expected a mapping of name -> array, or Parameter objects")
    return params
