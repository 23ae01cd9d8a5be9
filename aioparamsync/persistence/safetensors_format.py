"""The safetensors file layout, written by our own code: dtype names and the header.

A safetensors file is an 8-byte little-endian length, that many bytes of
JSON (each tensor's ``dtype``, ``shape`` and ``data_offsets`` in the data
that follows, and a ``__metadata__`` object of strings), then the tensors'
bytes, little-endian and C order, one after another. Writing it needs no
package: :func:`file_header` makes the first part from what each tensor will be
(so the bytes can follow one tensor at a time, as they are read), and the
file is what ``safetensors.numpy.load_file`` and ``safetensors.torch.load_file``
read. The snapshots of a data directory and ``aioparamsync-ctl export`` write
it so.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from ..values.arrays import parse_dtype

__all__ = ["METADATA", "SAFETENSORS_DTYPES", "Tensor", "file_header", "safetensors_dtype"]

# numpy dtype strings (the wire's, see values.arrays) that safetensors has a name for.
SAFETENSORS_DTYPES = {
    "<f8": "F64",
    "<f4": "F32",
    "<f2": "F16",
    "<i8": "I64",
    "<u8": "U64",
    "<i4": "I32",
    "<u4": "U32",
    "<i2": "I16",
    "<u2": "U16",
    "|i1": "I8",
    "|u1": "U8",
    "|b1": "BOOL",
    "<c8": "C64",
    "bfloat16": "BF16",  # (its wire bytes are little-endian, as safetensors wants)
}
# The header's key of the file's metadata (which no tensor may be named).
METADATA = "__metadata__"

# A tensor of the file: its name, safetensors dtype, shape and bytes.
Tensor = tuple[str, str, Sequence[int], int]


def safetensors_dtype(dtype: str) -> tuple[str, np.dtype | None] | None:
    """The safetensors name of the wire dtype ``dtype``, and the big-endian dtype to read
    its bytes as (to write them little-endian) or None; None: safetensors has none."""
    st = SAFETENSORS_DTYPES.get(dtype)
    if st is not None:
        return st, None
    dt = parse_dtype(dtype)  # ("float32" from a founding client reads as "<f4")
    swap = None
    if dt.byteorder == ">":
        swap, dt = dt, dt.newbyteorder("<")
    st = SAFETENSORS_DTYPES.get(dt.str)
    return None if st is None else (st, swap)


def file_header(
    tensors: Iterable[Tensor], metadata: Mapping[str, str] | None = None, *, size: int | None = None
) -> bytes:
    """The bytes a file of ``tensors`` (in this order) starts with, before their data.

    The JSON is padded with spaces to a multiple of 8 bytes (so the data starts
    aligned), or to exactly ``size`` bytes when given: a header written again
    once the data is there (its metadata known then) keeps the length of the
    first, which the data follows.

    Raises:
        ValueError: a tensor named ``__metadata__``; a header longer than ``size``.
    """
    entries: dict[str, object] = {}
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        if name == METADATA:
            raise ValueError(f"a safetensors file has no tensor named {METADATA!r}")
        entries[name] = {
            "dtype": dtype,
            "shape": [int(d) for d in shape],
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    if metadata is not None:
        entries[METADATA] = dict(metadata)
    text = json.dumps(entries, separators=(",", ":")).encode()
    if size is None:
        size = len(text) + (-len(text) % 8)
    elif len(text) > size:
        raise ValueError(f"the header takes {len(text)} bytes, more than the {size} it had")
    return struct.pack("<Q", size) + text.ljust(size)
