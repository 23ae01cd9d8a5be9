"""Many small parameters of one dtype in one block (the IDL's ``Packed``).

A read of 200 tensors of 4 KiB answered one ``Parameter`` each costs each side
a struct per tensor: the node makes, then encodes, 200 of them, and the client
decodes 200 and makes an array of each. Answered in a block, the node writes
one list of names, one of shapes, and the bytes one after another; the client
makes a view of each array in those bytes. :func:`pack` makes the blocks (the
node, for a read that asks: ``ParameterRequest.packed``), :func:`unpack` reads
them (the client, checking every count and length first: a block that does not
add up is refused whole).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..errors import RemoteProtocolError, RequestError
from ..wire import thrift
from .arrays import BFLOAT16, SWAP_BFLOAT16, array_of, parse_dtype

__all__ = ["arrays_of", "pack", "packed_response", "unpack"]


def pack(entries: Iterable[Any]) -> list[Any]:
    """Blocks of ``entries`` (each with ``name``, ``data``, ``version``, ``dtype``,
    ``shape`` and ``origin``, as a stored entry has), one per dtype, in their order."""
    blocks: dict[str, tuple[list, list, list, list, list]] = {}
    for e in entries:
        block = blocks.get(e.dtype)
        if block is None:
            block = blocks[e.dtype] = ([], [], [], [], [])
        names, shapes, datas, versions, origins = block
        names.append(e.name)
        shapes.append(len(e.shape))
        shapes += e.shape
        datas.append(e.data)
        versions.append(e.version)
        origins.append(e.origin)
    return [
        thrift.Packed(
            names=names,
            dtype=dtype,
            shapes=shapes,
            data=b"".join(datas),
            versions=versions,
            origins=origins,
        )
        for dtype, (names, shapes, datas, versions, origins) in blocks.items()
    ]


def unpack(blocks: Iterable[Any]) -> list[tuple[str, np.ndarray, int, str]]:
    """``(name, array, version, origin)`` of every parameter of ``blocks``; each array
    a read-only view of its block's bytes.

    Raises:
        RemoteProtocolError: a block whose counts, shapes or bytes do not add up, or
            of a dtype that is not numeric.
    """
    out = []
    for block in blocks:
        names, shapes, data = block.names, block.shapes, block.data
        versions, origins = block.versions, block.origins
        if not len(names) == len(versions) == len(origins):
            raise RemoteProtocolError(
                f"a packed block of {len(names)} names has {len(versions)} versions and "
                f"{len(origins)} origins"
            )
        try:
            dtype = parse_dtype(block.dtype)
        except RequestError as exc:
            raise RemoteProtocolError(f"a packed block: {exc.message}") from None
        swapped = SWAP_BFLOAT16 and block.dtype == BFLOAT16
        view = memoryview(data).cast("B")
        whole = np.frombuffer(view, np.uint8)
        size = dtype.itemsize
        at = offset = 0
        for name, version, origin in zip(names, versions, origins, strict=True):
            if at >= len(shapes) or not 0 <= shapes[at] <= 32:
                raise RemoteProtocolError(f"a packed block's shapes end or go wrong at {name!r}")
            ndim = shapes[at]
            shape = tuple(shapes[at + 1 : at + 1 + ndim])
            at += 1 + ndim
            if len(shape) != ndim or any(d < 0 for d in shape):
                raise RemoteProtocolError(f"a packed block's shape of {name!r} is {shape}")
            nbytes = math.prod(shape) * size
            if offset + nbytes > len(whole):
                raise RemoteProtocolError(
                    f"a packed block of {len(whole)} bytes ends within {name!r} (at {offset})"
                )
            array = whole[offset : offset + nbytes].view(dtype)
            if swapped:  # (as from_parameter reads it)
                array = array.view(np.uint16).byteswap().view(dtype)
            array = array.reshape(shape)
            offset += nbytes
            out.append((name, array, version, origin))
        if at != len(shapes) or offset != len(whole):
            raise RemoteProtocolError(
                f"a packed block holds {len(whole) - offset} bytes and {len(shapes) - at} "
                "shape values past its parameters"
            )
    return out


def packed_response(entries: list[Any], timestamp: int) -> Any:
    """A read's ``ParameterResponse`` of ``entries`` (stored entries), without their
    rules: those with a dtype and shape in blocks, any other (plain bytes, a key of a
    partitioned parameter) as a ``Parameter``."""
    laid, plain = [], []
    for e in entries:
        if e.dtype is not None and e.shape is not None and "\x00" not in e.name:
            laid.append(e)
        else:
            plain.append(e.to_parameter(False))
    return thrift.ParameterResponse(params=plain, timestamp=timestamp, packed=pack(laid) or None)


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
