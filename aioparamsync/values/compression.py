"""Encoded parameters: fp16, bf16, int8, top-k and zlib (error feedback: :mod:`.feedback`).

A ``Parameter`` whose ``encoding`` is set carries its array in a smaller form;
``dtype`` and ``shape`` always describe the array it decodes to (the dtype
string as :mod:`aioparamsync.values.arrays` writes it: numpy's ``dtype.str``, or
``"bfloat16"``). Every encoded payload is little-endian, whatever the dtype's
byte order:

- ``"fp16"``: the values cast to IEEE half precision (round to nearest even;
  beyond +-65504 they become +-inf: use ``"bf16"`` for a wide range).
  Relative error at most 2**-11 in fp16's normal range.
- ``"bf16"``: the values cast to bfloat16 (fp32's range, 8 significant bits).
  Relative error at most 2**-8 in the normal range.
- ``"int8"``: ``round(x / scale)`` clipped to [-127, 127] as int8, with
  ``scale = max|x| / 127`` in the ``scale`` field (an all-zero array: scale 0).
  Absolute error at most ``scale / 2``.
- ``"topk"``: the k = max(1, ceil(ratio * size)) values of largest magnitude,
  in the parameter's dtype, in ``data``; their flat (C-order) positions as
  int64, strictly ascending, in ``indices``. Every other element decodes to zero.
- ``"zlib"``: the array's own bytes (as :func:`~aioparamsync.values.arrays.to_parameter`
  sends them), deflated. Exact.

fp16, bf16, int8 and topk are for floating arrays (float16, float32, float64,
bfloat16); zlib for any numeric one. A pull may ask for any encoding but topk
(:data:`PULL_ENCODINGS`): a reader wants the whole array.

:func:`decode` treats its parameter as untrusted wire input: whatever the
bytes, it answers an array of exactly ``dtype`` x ``shape`` or raises
:class:`~aioparamsync.errors.RequestError`, and never allocates more than that
array (plus a bounded working buffer), so a "zip bomb" costs what the array would.

Lossy encodings bias training unless what they drop is sent later:
:class:`~aioparamsync.values.feedback.ErrorFeedback` keeps, per parameter,
what was not sent (the residual) and adds it to the next gradient (error
feedback, as in 1-bit SGD and Deep Gradient Compression), so the sum of what
is sent tracks the sum of the gradients to within one residual.

Pure numpy: no asyncio, no sockets; the node and the client both use it.
"""

from __future__ import annotations

import math
import sys
import zlib
from typing import Any, cast

import numpy as np

from ..errors import ErrorCode, RequestError
from ..wire import thrift
from .arrays import (
    BFLOAT16,
    NUMERIC_KINDS,
    SWAP_BFLOAT16,
    check_shape,
    from_parameter,
    is_bfloat16,
    parse_dtype,
    to_parameter,
    wire_dtype,
)

__all__ = [
    "ENCODINGS",
    "PULL_ENCODINGS",
    "decode",
    "decode_parameter",
    "decoded_nbytes",
    "encodable",
    "encode",
    "encoded_nbytes",
]

# Every encoding a Parameter may carry.
ENCODINGS = ("fp16", "bf16", "int8", "topk", "zlib")
# The encodings a pull may ask for (topk would hand a reader a mostly-zero array).
PULL_ENCODINGS = ("fp16", "bf16", "int8", "zlib")
# Encodings that lose precision, and need a floating dtype (float16/32/64, bfloat16).
LOSSY = frozenset(("fp16", "bf16", "int8", "topk"))
# Why an update (not a gradient) may not be sent in topk.
TOPK_IS_FOR_GRADIENTS = (
    "topk is for gradients (push_gradients): an update sent so would keep the largest "
    "values only and set the rest to 0"
)
# zlib inflates at most this many bytes at a time: decoding holds the array plus this.
ZLIB_CHUNK = 1 << 20
# Casts between float types meet inf and NaN as values, not as errors: no warnings.
_CASTS: dict[str, Any] = {"over": "ignore", "invalid": "ignore"}
# Largest int8 code: symmetric, so -x encodes to -q (int8's -128 is never sent).
_INT8_MAX = 127


def _is_float(dt: np.dtype) -> bool:
    return (dt.kind == "f" and dt.itemsize in (2, 4, 8)) or is_bfloat16(dt)


def encodable(dtype: str | None, encoding: str) -> bool:
    """Whether a parameter of wire dtype ``dtype`` can be sent in ``encoding``.

    Args:
        dtype: the wire dtype string (``None``: plain bytes, which only zlib takes).
        encoding: one of :data:`ENCODINGS`.

    Returns:
        True when :func:`encode` accepts such an array in that encoding.

    Raises:
        ValueError: an unknown encoding.
    """
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}; expected one of {ENCODINGS}")
    if dtype is None:
        return encoding == "zlib"
    try:
        dt = parse_dtype(dtype)
    except RequestError:
        return False
    return encoding not in LOSSY or _is_float(dt)


def _le_bytes(arr: np.ndarray) -> memoryview:
    """``arr``'s values as little-endian bytes, C order (a view when they already are)."""
    if is_bfloat16(arr.dtype):
        arr = arr.view(np.uint16)  # bfloat16 has no byte order of its own; its bits do
    arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    return memoryview(cast(Any, arr.reshape(-1).view(np.uint8)))


def _from_le(data: Any, dt: np.dtype) -> np.ndarray:
    """The values of little-endian ``data`` as an array of ``dt`` (a view when possible)."""
    if is_bfloat16(dt):
        return np.frombuffer(data, "<u2").astype(np.uint16, copy=False).view(dt)
    little = dt.newbyteorder("<")
    # (numpy's own instance where it is the same type: the compiled paths know them by it)
    return np.frombuffer(data, dt if little == dt else little)


def encode(name: str, array: Any, encoding: str, *, ratio: float = 0.01, level: int = 1) -> Any:
    """Encode an array as a ``Parameter`` in ``encoding``.

    Args:
        name: the parameter's name.
        array: the values (anything ``np.asarray`` takes); a floating dtype
            for fp16, bf16, int8 and topk, any numeric one for zlib.
        encoding: one of :data:`ENCODINGS`.
        ratio: topk: the fraction of elements to send, in (0, 1].
        level: zlib: the compression level, -1 (zlib's default) or 0..9.

    Returns:
        A ``Parameter`` with ``dtype`` and ``shape`` of the array, ``encoding``
        set, ``data`` the encoded bytes, and ``scale`` (int8) or ``indices``
        (topk) where the encoding has one.

    Raises:
        ValueError: an unknown encoding, a ratio or level out of range, or
            non-finite values for int8 (its scale would be non-finite).
        TypeError: the dtype is not one the encoding takes.
    """
    if encoding not in ENCODINGS:
        raise ValueError(f"{name!r}: unknown encoding {encoding!r}; expected one of {ENCODINGS}")
    arr = np.asarray(array)
    dt = arr.dtype
    if not is_bfloat16(dt) and (dt.kind not in NUMERIC_KINDS or dt.fields is not None):
        raise TypeError(f"{name!r}: cannot send an array of dtype {dt}")
    if encoding in LOSSY and not _is_float(dt):
        raise TypeError(f"{name!r}: {encoding} needs a floating array, not {dt}")
    param = thrift.Parameter(
        name=name, data=b"", dtype=wire_dtype(dt), shape=list(arr.shape), encoding=encoding
    )
    if encoding == "fp16":
        with np.errstate(**_CASTS):  # beyond fp16's range: +-inf, as documented
            param.data = _le_bytes(arr.astype(np.float16))
    elif encoding == "bf16":
        with np.errstate(**_CASTS):  # float64 beyond bfloat16's range: +-inf
            param.data = _le_bytes(arr.astype(parse_dtype(BFLOAT16)))
    elif encoding == "int8":
        param.data, param.scale = _int8(name, arr)
    elif encoding == "topk":
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"{name!r}: topk ratio must be in (0, 1], got {ratio}")
        param.data, param.indices = _topk(arr, ratio)
    else:
        if not -1 <= level <= 9:
            raise ValueError(f"{name!r}: zlib level must be -1 or 0..9, got {level}")
        param.data = zlib.compress(to_parameter(name, arr).data, level)
    return param


def _int8(name: str, arr: np.ndarray) -> tuple[memoryview, float]:
    x = arr.reshape(-1).astype(np.float64)
    amax = max(float(x.max()), -float(x.min())) if x.size else 0.0  # NaN stays NaN
    if not math.isfinite(amax):
        raise ValueError(f"{name!r}: int8 cannot encode non-finite values")
    # An all-zero array: scale 0 (every code decodes to 0). A float64 subnormal
    # max would underflow to 0: the smallest scale then still decodes it.
    scale = amax / _INT8_MAX
    if scale < sys.float_info.min:
        # A subnormal scale is coarse (or 0 for a tiny amax): it must still
        # cover amax, or the largest values would be clipped beyond scale / 2.
        while scale * _INT8_MAX < amax:
            scale = math.nextafter(scale, math.inf)
    q = np.zeros(x.size, np.int8)
    if scale:
        np.divide(x, scale, out=x)
        np.rint(x, out=x)
        np.clip(x, -_INT8_MAX, _INT8_MAX, out=x)
        q[:] = x
    return memoryview(cast(Any, q.view(np.uint8))), scale


def _topk(arr: np.ndarray, ratio: float) -> tuple[memoryview, bytes]:
    flat = arr.reshape(-1)
    n = flat.size
    k = min(n, max(1, math.ceil(ratio * n))) if n else 0
    if k < n:
        # bfloat16 has no partition of its own in numpy: rank by float32 magnitudes.
        mag = np.abs(flat.astype(np.float32) if is_bfloat16(flat.dtype) else flat)
        idx = np.argpartition(mag, n - k)[n - k :]
        idx.sort()
    else:
        idx = np.arange(n)
    return _le_bytes(flat[idx]), idx.astype("<i8").tobytes()


def _fail(code: ErrorCode, name: str, message: str) -> RequestError:
    return RequestError(code, f"{name!r}: {message}")


def _layout(param: Any) -> tuple[np.dtype, tuple[int, ...] | None]:
    """The decoded dtype and shape of an encoded parameter, checked.

    The shape is ``None`` only for plain bytes (no dtype) in zlib without a
    shape: their length is known once inflated.
    """
    name, encoding = param.name, param.encoding
    if encoding not in ENCODINGS:
        raise _fail(
            ErrorCode.BAD_REQUEST,
            name,
            f"unknown encoding {encoding!r}; expected one of {ENCODINGS}",
        )
    if param.dtype is None and encoding != "zlib":
        raise _fail(ErrorCode.SHAPE_MISMATCH, name, f"a {encoding} parameter needs a dtype")
    try:
        dt = parse_dtype(param.dtype) if param.dtype is not None else np.dtype(np.uint8)
    except RequestError as exc:
        raise _fail(ErrorCode(exc.code), name, exc.message) from None
    if encoding in LOSSY and not _is_float(dt):
        raise _fail(
            ErrorCode.BAD_REQUEST, name, f"{encoding} is for floating dtypes, not {param.dtype!r}"
        )
    if param.shape is not None:
        check_shape(name, param.shape)
        shape = tuple(int(d) for d in param.shape)
        # Plain bytes are one dimension whatever their shape says (as arrays.from_parameter).
        return dt, shape if param.dtype is not None else (math.prod(shape),)
    # No shape: one dimension, as long as the data says (where it can say).
    per_item = {"fp16": 2, "bf16": 2, "int8": 1}.get(encoding)
    if per_item is None:
        if param.dtype is None:
            return dt, None
        raise _fail(ErrorCode.SHAPE_MISMATCH, name, f"a {encoding} parameter needs a shape")
    nbytes = memoryview(param.data).nbytes
    if nbytes % per_item:
        raise _fail(
            ErrorCode.SHAPE_MISMATCH,
            name,
            f"{nbytes} bytes is not a whole number of {encoding} items",
        )
    return dt, (nbytes // per_item,)


def decoded_nbytes(param: Any) -> int | None:
    """How many bytes the array a parameter holds takes once decoded.

    Computed from ``dtype`` and ``shape`` alone (nothing is decoded), so a node
    can bound it before calling :func:`decode`.

    Args:
        param: a ``Parameter``, encoded or not.

    Returns:
        The decoded array's ``nbytes`` (a raw parameter: its data's length);
        ``None`` for plain bytes (no dtype) in zlib without a shape, whose
        length only inflating tells.

    Raises:
        RequestError: the encoding, dtype or shape is invalid (as :func:`decode`).
    """
    if not param.encoding:
        return memoryview(param.data).nbytes
    dt, shape = _layout(param)
    return None if shape is None else math.prod(shape) * dt.itemsize


def encoded_nbytes(param: Any) -> int:
    """The bytes a parameter's array takes on the wire: ``data`` and ``indices``."""
    indices = param.indices
    return memoryview(param.data).nbytes + (memoryview(indices).nbytes if indices else 0)


def decode(param: Any, *, max_nbytes: int | None = None) -> np.ndarray:
    """The array an encoded ``Parameter`` holds.

    Args:
        param: a ``Parameter``; its fields are checked as untrusted input.
        max_nbytes: refuse a decoded array larger than this (``None``: the
            caller has bounded dtype x shape already). Plain bytes (no dtype)
            in zlib without a shape need it: it bounds the inflating.

    Returns:
        A new, writable array of the parameter's dtype and shape (plain bytes:
        one dimension of uint8). A parameter without an encoding (``None`` or
        ``""``) is raw: the answer is then
        :func:`~aioparamsync.values.arrays.from_parameter`'s view of its bytes
        (read-only when they are), not a copy.

    Raises:
        RequestError: naming the parameter. BAD_REQUEST: an unknown encoding,
            one not for this dtype, an int8 scale that is missing, negative
            or non-finite, topk indices that are malformed (not whole int64s,
            not as many as the values, negative, out of range, repeated or
            unsorted), zlib data that is corrupt, truncated or followed by
            other bytes. SHAPE_MISMATCH: no dtype (where one is needed), a
            non-numeric dtype, a bad shape, or data (zlib: once inflated) whose
            length does not fit them. LIMIT_EXCEEDED: the array is larger than
            ``max_nbytes``.
    """
    if not param.encoding:
        return from_parameter(param)
    name, encoding = param.name, param.encoding
    dt, shape = _layout(param)
    if shape is None:  # plain bytes in zlib, length unsaid: bounded by max_nbytes alone
        if max_nbytes is None:
            raise _fail(
                ErrorCode.SHAPE_MISMATCH,
                name,
                "plain bytes in zlib need a shape (their length) to be decoded",
            )
        return _inflate(param, max_nbytes, None)
    n = math.prod(shape)
    if max_nbytes is not None and n * dt.itemsize > max_nbytes:
        raise _fail(
            ErrorCode.LIMIT_EXCEEDED,
            name,
            f"decodes to {n * dt.itemsize} bytes; at most {max_nbytes}",
        )
    data = param.data
    nbytes = memoryview(data).nbytes
    if encoding in ("fp16", "bf16", "int8"):
        per_item = 1 if encoding == "int8" else 2
        if nbytes != n * per_item:
            raise _fail(
                ErrorCode.SHAPE_MISMATCH,
                name,
                f"shape {shape} in {encoding} needs {n * per_item} bytes, got {nbytes}",
            )
    if encoding == "fp16":
        with np.errstate(**_CASTS):
            return np.frombuffer(data, "<f2").astype(dt).reshape(shape)
    if encoding == "bf16":
        with np.errstate(**_CASTS):  # into a float16 parameter: beyond 65504 is inf
            return _from_le(data, parse_dtype(BFLOAT16)).astype(dt).reshape(shape)
    if encoding == "int8":
        return _decode_int8(param, dt, shape)
    if encoding == "topk":
        return _decode_topk(param, dt, shape, n)
    out = np.empty(n, dt)
    _inflate(param, n * dt.itemsize, out.view(np.uint8))
    if SWAP_BFLOAT16 and is_bfloat16(dt):  # its wire bytes are little-endian
        out.view(np.uint16).byteswap(inplace=True)
    return out.reshape(shape)


def _decode_int8(param: Any, dt: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    scale = param.scale
    if scale is None or not math.isfinite(scale) or scale < 0:
        raise _fail(
            ErrorCode.BAD_REQUEST,
            param.name,
            f"int8 needs a finite, non-negative scale, got {scale!r}",
        )
    out = np.empty(shape, dt)
    q = np.frombuffer(param.data, np.int8).reshape(shape)
    # float64 products, cast into `out` in buffered chunks (no float64 copy of the array);
    # a huge scale may overflow to inf, which the sender asked for.
    with np.errstate(**_CASTS):
        np.multiply(q, np.float64(scale), out=out, casting="unsafe")
    return out


def _decode_topk(param: Any, dt: np.dtype, shape: tuple[int, ...], n: int) -> np.ndarray:
    name, indices = param.name, param.indices
    if indices is None:
        raise _fail(ErrorCode.BAD_REQUEST, name, "topk needs indices")
    nidx = memoryview(indices).nbytes
    if nidx % 8:
        raise _fail(
            ErrorCode.BAD_REQUEST,
            name,
            f"topk indices: {nidx} bytes is not a whole number of int64",
        )
    k = nidx // 8
    nbytes = memoryview(param.data).nbytes
    if nbytes != k * dt.itemsize:
        raise _fail(
            ErrorCode.BAD_REQUEST,
            name,
            f"topk: {k} indices need {k * dt.itemsize} bytes of values, got {nbytes}",
        )
    if k > n:
        raise _fail(ErrorCode.BAD_REQUEST, name, f"topk: {k} indices for {n} elements")
    idx = np.frombuffer(indices, "<i8")
    if k:
        if idx.min() < 0:
            raise _fail(ErrorCode.BAD_REQUEST, name, "topk: a negative index")
        if idx.max() >= n:
            raise _fail(
                ErrorCode.BAD_REQUEST, name, f"topk: index {int(idx.max())} out of range for {n}"
            )
        if k > 1 and not (idx[1:] > idx[:-1]).all():
            raise _fail(
                ErrorCode.BAD_REQUEST, name, "topk: indices repeated or not in ascending order"
            )
    out = np.zeros(n, dt)
    out[idx] = _from_le(param.data, dt)
    return out.reshape(shape)


def _inflate(param: Any, size: int, into: np.ndarray | None) -> np.ndarray:
    """Inflate ``param.data``: into ``into`` (uint8, exactly ``size`` bytes) or, when
    ``into`` is None, into a new uint8 array of at most ``size`` bytes."""
    name = param.name
    grown = bytearray() if into is None else None
    data = memoryview(param.data).cast("B")
    inflater = zlib.decompressobj()
    fed = pos = 0
    tail: Any = b""
    try:
        while True:
            # Input goes in slices too: zlib copies what it leaves over (unconsumed_tail),
            # so the whole input at once would cost a copy of the rest at every step.
            if not tail and fed < len(data):
                tail = data[fed : fed + ZLIB_CHUNK]
                fed += len(tail)
            # One byte more than fits is asked for: inflating past `size` shows after
            # at most that byte, so a "zip bomb" costs no more than the array.
            chunk = inflater.decompress(tail, min(ZLIB_CHUNK, size - pos + 1))
            if len(chunk) > size - pos:
                if into is None:
                    raise _fail(
                        ErrorCode.LIMIT_EXCEEDED,
                        name,
                        f"zlib data inflates to more than {size} bytes",
                    )
                raise _fail(
                    ErrorCode.SHAPE_MISMATCH,
                    name,
                    f"zlib data inflates to more than the {size} bytes that "
                    f"shape {tuple(param.shape)} of {param.dtype} needs",
                )
            if grown is not None:
                grown += chunk
            elif into is not None:
                into[pos : pos + len(chunk)] = np.frombuffer(chunk, np.uint8)
            pos += len(chunk)
            progressed = bool(chunk) or len(inflater.unconsumed_tail) != len(tail)
            tail = inflater.unconsumed_tail
            if inflater.eof or not progressed:
                break
    except zlib.error as exc:
        raise _fail(ErrorCode.BAD_REQUEST, name, f"zlib data is corrupt ({exc})") from None
    if not inflater.eof:
        raise _fail(ErrorCode.BAD_REQUEST, name, "zlib data is truncated")
    if inflater.unused_data or fed < len(data):
        raise _fail(ErrorCode.BAD_REQUEST, name, "zlib data has bytes after its end")
    if into is None:
        return np.frombuffer(cast(Any, grown), np.uint8)  # writable: over a bytearray
    if pos != size:
        raise _fail(
            ErrorCode.SHAPE_MISMATCH,
            name,
            f"zlib data inflates to {pos} bytes; shape {tuple(param.shape)} "
            f"of {param.dtype} needs {size}",
        )
    return into


def decode_parameter(param: Any, *, max_nbytes: int | None = None) -> Any:
    """The raw ``Parameter`` of an encoded one: its array's own bytes, no encoding.

    Name, version, origin and rule are kept; ``encoding``, ``scale`` and
    ``indices`` are cleared. A raw parameter is answered as it is.

    Args:
        param: a ``Parameter``; checked as :func:`decode` checks it.
        max_nbytes: as for :func:`decode`.

    Returns:
        A ``Parameter`` whose ``data`` is the decoded array's bytes (plain bytes
        stay plain: no dtype, the shape they came with).

    Raises:
        RequestError: as :func:`decode`.
    """
    if not param.encoding:
        return param
    arr = decode(param, max_nbytes=max_nbytes)
    raw = to_parameter(param.name, arr, param.version or 0)
    raw.origin, raw.rule = param.origin, param.rule
    if param.dtype is None:
        raw.dtype, raw.shape = None, param.shape
    return raw
