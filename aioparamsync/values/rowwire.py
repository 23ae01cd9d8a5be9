"""Embedding rows on the wire: ids and row blocks as ``binary`` fields, one array each.

An id list is little-endian int64 bytes; a block of rows is the IDL's ``Rows``:
``count`` x ``dim`` values, C order, raw (in ``dtype``) or encoded:

- ``"fp16"``, ``"bf16"``: the values in that type (relative error at most
  2**-11, 2**-8 in the normal range; fp16 saturates to +-inf beyond 65504).
- ``"int8"``: ``round(x / s)`` clipped to [-127, 127], a float32 scale ``s``
  per row (``max|row| / 127``) in ``scales``: absolute error at most ``s / 2``
  per row, so a small row next to a large one keeps its precision.

:func:`decode_rows` treats its input as untrusted: it answers an array of
exactly ``(count, dim)`` or raises :class:`RequestError`, and allocates no
more than that array. Pure numpy: the node and the client both use it.
"""

from __future__ import annotations

import sys
from typing import Any, cast

import numpy as np

from ..errors import ErrorCode, RequestError
from ..wire import thrift
from .arrays import is_bfloat16, parse_dtype, wire_dtype
from .compression import _from_le, _le_bytes

__all__ = [
    "ROW_ENCODINGS",
    "decode_ids",
    "decode_rows",
    "encode_ids",
    "encode_rows",
    "rows_in",
    "rows_nbytes",
    "rows_out",
    "shareable",
]

#: the encodings a block of rows may travel in (besides raw)
ROW_ENCODINGS = ("fp16", "bf16", "int8")
_INT8_MAX = 127
_LE_INT64 = np.dtype("<i8")
_LE_FLOAT32 = np.dtype("<f4")


def _bad(message: str, code: ErrorCode = ErrorCode.BAD_REQUEST) -> RequestError:
    return RequestError(code, message)


def encode_ids(ids: np.ndarray) -> memoryview:
    """``ids`` (int64, 1-D) as little-endian bytes (a view when they already are)."""
    return memoryview(cast(Any, np.ascontiguousarray(ids, _LE_INT64))).cast("B")


def decode_ids(data: Any, what: str = "ids") -> np.ndarray:
    """The int64 ids of little-endian ``data`` (a read-only view of it).

    Raises:
        RequestError: (BAD_REQUEST) no bytes, or a length that is no multiple of 8.
    """
    if data is None:
        raise _bad(f"{what} are missing")
    n = len(data)
    if n % 8:
        raise _bad(f"{what} are little-endian int64: {n} bytes is no multiple of 8")
    ids = np.frombuffer(data, _LE_INT64)
    return ids if sys.byteorder == "little" else ids.astype(np.int64)


def encode_rows(rows: np.ndarray, encoding: str | None = None) -> Any:
    """A ``(count, dim)`` float array as the IDL's ``Rows``, raw or in ``encoding``.

    Raises:
        ValueError: not a 2-D float array, an unknown encoding, or (int8) values
            that are not finite.
    """
    if rows.ndim != 2:
        raise ValueError(f"rows are (count, dim), not of shape {rows.shape}")
    dt = rows.dtype
    if not (dt.kind == "f" or is_bfloat16(dt)):
        raise ValueError(f"rows are of a float dtype, not {dt}")
    count, dim = rows.shape
    out = thrift.Rows(count=count, dim=dim, dtype=wire_dtype(dt))
    if encoding is None:
        out.data = _le_bytes(rows)
    elif encoding == "fp16":
        out.data = _le_bytes(rows.astype(np.float16))
    elif encoding == "bf16":
        out.data = _le_bytes(rows.astype(parse_dtype("bfloat16")))
    elif encoding == "int8":
        x = rows.astype(np.float32)
        if not np.isfinite(x).all():
            raise ValueError("int8 cannot encode rows with values that are not finite")
        scales = np.abs(x).max(axis=1) / _INT8_MAX if count and dim else np.zeros(count, "f4")
        safe = np.where(scales > 0, scales, 1.0).astype(np.float32)
        q = np.rint(x / safe[:, None])
        np.clip(q, -_INT8_MAX, _INT8_MAX, out=q)
        out.data = memoryview(q.astype(np.int8).reshape(-1).view(np.uint8))
        out.scales = _le_bytes(scales.astype(np.float32))
    else:
        raise ValueError(f"encoding is one of {', '.join(ROW_ENCODINGS)} or None, not {encoding!r}")
    out.encoding = encoding
    return out


def shareable(dt: np.dtype) -> bool:
    """Whether rows of ``dt`` are raw as they lie in memory (little-endian)."""
    return sys.byteorder == "little" and dt.byteorder in "=<|"


def rows_out(request: Any, count: int, dim: int, dtype: np.dtype) -> tuple[np.ndarray, Any]:
    """Where a pull of ``count`` rows writes them: an array of its own, and None; or,
    where ``request`` (a ``RowsRequest``) was lent a region that holds them raw
    (``request.lent``, a :class:`~.sharedmem.SharedView`: see ``server.shared``), an
    array in that region, and the answer that says so (``Rows.shared``)."""
    lent = getattr(request, "lent", None)
    nbytes = count * dim * dtype.itemsize
    if (
        lent is None
        or request.encoding is not None
        or not 0 < nbytes <= lent.view.nbytes
        or not shareable(dtype)
    ):
        return np.empty((count, dim), dtype), None
    out = np.frombuffer(lent.view, dtype, count * dim).reshape(count, dim)
    shared = thrift.SharedRegion(
        segment=lent.shared.segment, offset=lent.shared.offset, size=nbytes
    )
    return out, thrift.Rows(count=count, dim=dim, dtype=wire_dtype(dtype), data=b"", shared=shared)


def rows_in(view: memoryview, rows: np.ndarray) -> Any:
    """``rows`` (a ``(count, dim)`` float array of a little-endian dtype) written into
    ``view`` (a region of shared memory, as large), as the IDL's ``Rows`` (``shared``
    to be set by the caller; ``data`` empty)."""
    count, dim = rows.shape
    out = np.frombuffer(view, rows.dtype, count * dim).reshape(count, dim)
    np.copyto(out, rows)
    return thrift.Rows(count=count, dim=dim, dtype=wire_dtype(rows.dtype), data=b"")


def rows_nbytes(count: int, dim: int, encoding: str | None, itemsize: int) -> int:
    """The bytes ``Rows`` of ``count`` x ``dim`` take in ``encoding`` (data and scales)."""
    n = count * dim
    if encoding is None:
        return n * itemsize
    if encoding == "int8":
        return n + 4 * count
    return 2 * n


def decode_rows(rows: Any, *, count: int | None = None, dim: int | None = None) -> np.ndarray:
    """The ``(count, dim)`` array of a ``Rows`` (a read-only view of raw data).

    Args:
        rows: the IDL's ``Rows``, as received.
        count, dim: what it must hold (the ids sent with it; the table's width).

    Raises:
        RequestError: missing fields, a count or width other than expected
            (SHAPE_MISMATCH), data of the wrong length, an unknown encoding or
            a dtype that is not a float.
    """
    if rows is None:
        raise _bad("the rows are missing")
    if not isinstance(rows.count, int) or not isinstance(rows.dim, int):
        raise _bad("rows need a count and a dim")
    if rows.count < 0 or rows.dim < 0:
        raise _bad(f"rows of {rows.count} x {rows.dim}: a count and dim are not negative")
    if count is not None and rows.count != count:
        raise _bad(f"{rows.count} rows for {count} ids", ErrorCode.SHAPE_MISMATCH)
    if dim is not None and rows.dim != dim:
        raise _bad(f"rows of width {rows.dim}; the table's is {dim}", ErrorCode.SHAPE_MISMATCH)
    if not isinstance(rows.dtype, str):
        raise _bad("rows need a dtype")
    dt = parse_dtype(rows.dtype)
    if not (dt.kind == "f" or is_bfloat16(dt)):
        raise _bad(f"rows are of a float dtype, not {rows.dtype!r}", ErrorCode.SHAPE_MISMATCH)
    if rows.shared is not None:  # (a node that maps it sets data so: server.shared)
        raise _bad("rows in shared memory reach only a node that maps the sender's memory")
    if rows.data is None:
        raise _bad("the rows' data is missing")
    n, d = rows.count, rows.dim
    encoding = rows.encoding
    if encoding is None:
        wire, itemsize = dt, dt.itemsize
    elif encoding == "fp16":
        wire, itemsize = np.dtype(np.float16), 2
    elif encoding == "bf16":
        wire, itemsize = parse_dtype("bfloat16"), 2
    elif encoding == "int8":
        wire, itemsize = np.dtype(np.int8), 1
    else:
        raise _bad(f"rows are encoded as one of {', '.join(ROW_ENCODINGS)}, not {encoding!r}")
    if len(rows.data) != n * d * itemsize:
        raise _bad(
            f"{n} x {d} rows ({encoding or rows.dtype}) are {n * d * itemsize} bytes, "
            f"not {len(rows.data)}",
            ErrorCode.SHAPE_MISMATCH,
        )
    values = _from_le(rows.data, wire).reshape(n, d)
    if encoding is None:
        return values
    if encoding != "int8":
        return values.astype(dt)
    if rows.scales is None or len(rows.scales) != 4 * n:
        got = "none" if rows.scales is None else f"{len(rows.scales)} bytes"
        raise _bad(f"int8 rows need a float32 scale per row ({4 * n} bytes), not {got}")
    scales = np.frombuffer(rows.scales, _LE_FLOAT32)
    if not (np.isfinite(scales).all() and (scales >= 0).all()):
        raise _bad("int8 rows' scales are finite and not negative")
    return (values.astype(np.float32) * scales[:, None]).astype(dt)
