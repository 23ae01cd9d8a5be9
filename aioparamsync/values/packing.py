"""Many small parameters of one dtype in one block (the IDL's ``Packed``).

A read of 200 tensors of 4 KiB answered one ``Parameter`` each costs each side
a struct per tensor: the node makes, then encodes, 200 of them, and the client
decodes 200 and makes an array of each. Answered in a block, the node writes
one list of names, one of shapes, and the bytes one after another; the client
makes a view of each array in those bytes. :func:`pack` makes the blocks (the
node, for a read that asks: ``ParameterRequest.packed``), :func:`unpack` reads
them (the client, checking every count and length first: a block that does not
add up is refused whole). A push's small gradients go so too
(``GradientPush.packed``): :func:`pack_arrays` makes their blocks (the client),
:func:`gradients_of` a ``Parameter`` of each, a view of its block's bytes (the
node, which folds them as if each had come so).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .._ext import compiled
from ..errors import ErrorCode, RemoteProtocolError, RequestError
from ..wire import thrift
from ..wire.writer import ZERO_COPY_MIN_BYTES
from .arrays import BFLOAT16, SWAP_BFLOAT16, array_of, parse_dtype
from .sharedmem import SHARED_MIN_BYTES, SharedView, nbytes_of, pack_into

__all__ = [
    "arrays_of",
    "gradients_of",
    "pack",
    "pack_arrays",
    "packed_response",
    "shared_answer",
    "shared_response",
    "unpack",
]


def pack(entries: Iterable[Any]) -> list[Any]:
    """Blocks of ``entries`` (each with ``name``, ``data``, ``version``, ``dtype``,
    ``shape`` and ``origin``, as a stored entry has), one per dtype."""
    groups: dict[str, list[Any]] = {}
    for e in entries:
        groups.setdefault(e.dtype, []).append(e)
    blocks = []
    for dtype, group in groups.items():
        block = _block(dtype, [(e.name, e.shape, e.data) for e in group])
        block.versions = [e.version for e in group]
        block.origins = [e.origin for e in group]
        blocks.append(block)
    return blocks


def pack_arrays(arrays: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """Blocks of the small arrays of ``arrays`` (numpy's, C-contiguous, of an integer or
    float dtype of numpy's own, each of fewer than ``ZERO_COPY_MIN_BYTES``: bytes that
    the encoder would copy anyway), and the other arrays, by name."""
    groups: dict[np.dtype, list[tuple[str, Sequence[int], Any]]] = {}
    rest = {}
    for name, a in arrays.items():
        if (
            type(a) is np.ndarray
            and 0 < a.nbytes < ZERO_COPY_MIN_BYTES
            and a.flags.c_contiguous
            and a.dtype.kind in "iuf"
        ):
            groups.setdefault(a.dtype, []).append((name, a.shape, a))
        else:
            rest[name] = a
    return [_block(dtype.str, items) for dtype, items in groups.items()], rest


def _block(dtype: str, items: Sequence[tuple[str, Sequence[int], Any]]) -> Any:
    """A block of ``items``, each ``(name, shape, data)``, of ``dtype``."""
    names, shapes, datas = [], [], []
    for name, shape, data in items:
        names.append(name)
        shapes.append(len(shape))
        shapes += shape
        datas.append(data)
    return thrift.Packed(names=names, dtype=dtype, shapes=shapes, data=b"".join(datas))


def unpack(blocks: Iterable[Any]) -> list[tuple[str, np.ndarray, int, str]]:
    """``(name, array, version, origin)`` of every parameter of ``blocks`` (an answer's);
    each array a read-only view of its block's bytes.

    Raises:
        RemoteProtocolError: a block whose counts, shapes or bytes do not add up, or
            of a dtype that is not numeric.
    """
    out = []
    for block in blocks:
        names, versions, origins = block.names, block.versions or [], block.origins or []
        if not len(names) == len(versions) == len(origins):
            raise RemoteProtocolError(
                f"a packed block of {len(names)} names has {len(versions)} versions and "
                f"{len(origins)} origins"
            )
        try:
            laid = _laid(block)
        except RequestError as exc:  # (its dtype; a ValueError too: first)
            raise RemoteProtocolError(f"a packed block: {exc.message}") from None
        except ValueError as exc:
            raise RemoteProtocolError(str(exc)) from None
        dtype, data = parse_dtype(block.dtype), block.data
        size, swapped = dtype.itemsize, SWAP_BFLOAT16 and block.dtype == BFLOAT16
        for (name, shape, start, stop), version, origin in zip(
            laid, versions, origins, strict=True
        ):
            array = np.frombuffer(data, dtype, (stop - start) // size, start)
            if swapped:  # (as from_parameter reads it)
                array = array.view(np.uint16).byteswap().view(dtype)
            if len(shape) != 1:
                array = array.reshape(shape)
            out.append((name, array, version, origin))
    return out


def gradients_of(blocks: Iterable[Any]) -> list[Any]:
    """A ``Parameter`` of each gradient of ``blocks`` (a push's): its data a view of its
    block's bytes, its dtype and shape the block's.

    Raises:
        RequestError: (BAD_REQUEST) a block whose counts, shapes or bytes do not add
            up, or of a dtype that is not numeric (SHAPE_MISMATCH).
    """
    if type(blocks) is list and _cpacking is not None:  # (the same, compiled; None: not here)
        made = _cpacking.gradients_of(
            blocks, thrift.Parameter, _DEFAULTS, _itemsize, MAX_DIMENSIONS
        )
        if made is not None:
            return made
    made = []
    new, cls = object.__new__, thrift.Parameter
    for block in blocks:
        if block.shared is not None:  # (not mapped: see server.shared)
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                "gradients in shared memory are taken only from a client on the node's "
                "Unix socket, of the node's user",
            )
        try:
            laid = _laid(block)
        except RequestError:  # (its dtype, SHAPE_MISMATCH; a ValueError too: first)
            raise
        except ValueError as exc:
            raise RequestError(ErrorCode.BAD_REQUEST, str(exc)) from None
        view, dtype = memoryview(block.data).cast("B"), block.dtype
        for name, shape, start, stop in laid:
            # (as the decoder makes a struct: its defaults, then its fields)
            p = new(cls)
            p.__dict__ = attributes = _DEFAULTS.copy()
            attributes["name"] = name
            attributes["data"] = view[start:stop]
            attributes["dtype"] = dtype
            attributes["shape"] = shape  # (a list of its own: _laid's)
            made.append(p)
    return made


_DEFAULTS = vars(thrift.Parameter(name="", data=b""))
# gradients_of's loop, compiled (see _cpacking.pyx), unless the pure path is asked for
_cpacking = compiled("values._cpacking")


def _itemsize(dtype: str) -> int:
    return parse_dtype(dtype).itemsize


def _laid(block: Any) -> list[tuple[str, list[int], int, int]]:
    """``(name, shape, start, stop)`` of each of ``block``'s parameters, its bytes
    ``[start, stop)`` of the block's; checked to add up (ValueError, naming what does
    not; a dtype not numeric: RequestError)."""
    shapes, nbytes = block.shapes, memoryview(block.data).nbytes
    size = parse_dtype(block.dtype).itemsize
    last = len(shapes) - 1
    out = []
    at = offset = 0
    for name in block.names:
        if at < last and shapes[at] == 1 and (n := shapes[at + 1]) >= 0:
            shape, count = [n], n  # (a vector, the common case, at once)
            at += 2
        else:
            ndim = shapes[at] if at <= last else -1
            if not 0 <= ndim <= MAX_DIMENSIONS:
                raise ValueError(f"a packed block's shapes end or go wrong at {name!r}")
            shape = shapes[at + 1 : at + 1 + ndim]
            at += 1 + ndim
            if len(shape) != ndim or any(d < 0 for d in shape):
                raise ValueError(f"a packed block's shape of {name!r} is {shape}")
            count = math.prod(shape)
        stop = offset + count * size
        if stop > nbytes:
            raise ValueError(f"a packed block of {nbytes} bytes ends within {name!r} (at {offset})")
        out.append((name, shape, offset, stop))
        offset = stop
    if at != len(shapes) or offset != nbytes:
        raise ValueError(
            f"a packed block holds {nbytes - offset} bytes and {len(shapes) - at} shape values "
            "past its parameters"
        )
    return out


# numpy's most dimensions (NPY_MAXDIMS: 32 in numpy 1, 64 in numpy 2)
MAX_DIMENSIONS = 64


def packed_response(entries: list[Any], timestamp: int) -> Any:
    """A read's ``ParameterResponse`` of ``entries`` (stored entries), without their
    rules: the small ones with a dtype and shape in blocks (fewer bytes than
    ``ZERO_COPY_MIN_BYTES``: the encoder would copy them anyway, where a larger one is
    sent by reference), any other (plain bytes, a key of a partitioned parameter) as a
    ``Parameter``."""
    if _cpacking is not None:  # (the same, compiled)
        blocks, rest = _cpacking.packed_blocks(entries, thrift.Packed, ZERO_COPY_MIN_BYTES)
        plain = [e.to_parameter(False) for e in rest]
        return thrift.ParameterResponse(params=plain, timestamp=timestamp, packed=blocks or None)
    laid, plain = [], []
    for e in entries:
        if (
            e.dtype is not None
            and e.shape is not None
            and e.data.nbytes < ZERO_COPY_MIN_BYTES
            and "\x00" not in e.name
        ):
            laid.append(e)
        else:
            plain.append(e.to_parameter(False))
    return thrift.ParameterResponse(params=plain, timestamp=timestamp, packed=pack(laid) or None)


def shared_response(request: Any, entries: list[Any], timestamp: int) -> Any:
    """A read's ``ParameterResponse`` of ``entries`` (stored entries, no manifest) as
    :func:`packed_response` makes it, but with the raw ones of ``SHARED_MIN_BYTES`` or
    more in blocks written into the region the client lent (``request.lent``: see
    ``server.shared``); None where there is none, the read is encoded or a piece, no
    entry is that large, or they do not fit."""
    lent = getattr(request, "lent", None)
    if lent is None or request.encoding or request.piece_offset is not None:
        return None
    rows, rest = [], []
    for e in entries:
        if (
            e.dtype is not None
            and e.shape is not None
            and e.data.nbytes >= SHARED_MIN_BYTES
            and "\x00" not in e.name
        ):
            rows.append((e.dtype, e.name, e.shape, e.data, e.version, e.origin))
        else:
            rest.append(e)
    if not rows or (blocks := _shared_blocks(lent, rows)) is None:
        return None
    response = packed_response(rest, timestamp)
    response.packed = [*blocks, *(response.packed or ())]
    return response


def shared_answer(response: Any, lent: SharedView) -> Any:
    """``response`` (a read's answer, with no blocks yet) with its raw parameters (a dtype
    and a shape; not encoded, not in pieces, not a key of a partition) in blocks
    written into ``lent``, the client's region of shared memory; as it was if they do
    not fit."""
    rows, rest = [], []
    for p in response.params:
        if (
            p.dtype is not None
            and p.shape is not None
            and p.encoding is None
            and p.total_bytes is None
            and "\x00" not in p.name
            and nbytes_of(p.data) >= SHARED_MIN_BYTES
        ):
            rows.append((p.dtype, p.name, p.shape, p.data, p.version, p.origin))
        else:
            rest.append(p)
    if response.packed or not rows or (blocks := _shared_blocks(lent, rows)) is None:
        return response
    response.params, response.packed = rest, blocks
    return response


def _shared_blocks(lent: SharedView, rows: list[tuple]) -> list[Any] | None:
    """Blocks of ``rows`` (each ``(dtype, name, shape, data, version, origin)``), one per
    dtype, their bytes written into ``lent``; None if they do not fit."""
    groups: dict[str, list[tuple]] = {}
    for row in rows:
        groups.setdefault(row[0], []).append(row)
    blocks = pack_into(lent, [(d, [r[1:4] for r in g]) for d, g in groups.items()])
    if blocks is not None:
        for block, group in zip(blocks, groups.values(), strict=True):
            block.versions = [r[4] for r in group]
            block.origins = [r[5] for r in group]
    return blocks


def arrays_of(response: Any) -> dict[str, np.ndarray]:
    """A read's ``ParameterResponse`` as name -> array: its parameters' (``array_of``)
    and its blocks'.

    Raises:
        RemoteProtocolError: a block that does not add up (see :func:`unpack`).
        RequestError: (SHAPE_MISMATCH) a parameter's bytes do not fit its dtype and shape.
    """
    arrays = {p.name: array_of(p) for p in response.params}
    if response.packed:
        arrays.update((name, a) for name, a, _, _ in unpack(response.packed))
    return arrays
