"""Large parameters as partitions: the layout, the cut, and the whole again.

Theory of operation. In a cluster, a parameter of more than ``per`` elements
is stored as partitions: partition ``i`` holds its flat elements
``[i * per, (i + 1) * per)`` as an ordinary one-dimensional parameter of the
same dtype under the key :func:`~aioparamsync.placement.partition_key`
``(name, i)``, placed (replicated, logged, moved) independently of the
others, so a large tensor's pushes, pulls and gradient folds spread over the
cluster. ``per`` is ``partition_bytes // 4`` (``partition_bytes`` of float32),
whatever the dtype, so that a parameter and its gradients (which may come in
another dtype) cut at the same elements; plain bytes (no dtype) cut every
``partition_bytes`` bytes.

Its **manifest** (:class:`Layout`: dtype, shape, elements, per) is a small
plain-bytes entry under :func:`~aioparamsync.placement.manifest_key`
``(name)``, placed by the name itself, so that a read of the name finds the
parameter, or its manifest, at the same nodes. The parameter's version is the
smallest of its partitions' (each write of the whole advances every one).

Pure functions (no I/O, no asyncio): the nodes, which cut what founding
clients send and put together what they read, and the routed client, which
does both itself, use the same ones.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..placement import manifest_key, partition_key
from ..wire import thrift
from ..wire.writer import Chunks
from .arrays import MAX_DIMS, parse_dtype

__all__ = [
    "DEFAULT_PARTITION_BYTES",
    "ELEMENT_BYTES",
    "Layout",
    "assemble",
    "elements_of",
    "itemsize",
    "layout_for",
    "manifest",
    "per_partition",
    "readable",
    "split",
]

# The nodes' --partition-bytes by default (see benchmarks/README.md).
DEFAULT_PARTITION_BYTES = 4 * 1024 * 1024
# partition_bytes counts elements of this many bytes (float32's).
ELEMENT_BYTES = 4
# The manifest's format (its JSON says which).
FORMAT = 1
# The bytes an item of each encoding's data takes (raw: the dtype's itemsize).
_ENCODED_ITEM = {"fp16": 2, "bf16": 2, "int8": 1}
# Encodings a parameter is cut in as it is (each element's bytes on their own).
SPLITTABLE = frozenset((None, "fp16", "bf16", "int8", "topk"))
# A partition's or manifest's key as repr() shows it in a message.
_KEY_IN_MESSAGE = re.compile(r"\\x00#(m|\d+)")


def readable(message: str) -> str:
    """``message`` with partition keys as ``name[partition i]`` (manifests: ``name[manifest]``)."""
    return _KEY_IN_MESSAGE.sub(
        lambda m: "[manifest]" if m.group(1) == "m" else f"[partition {m.group(1)}]", message
    )


def per_partition(partition_bytes: int, plain: bool = False) -> int:
    """The elements of a partition: ``partition_bytes`` of float32 (plain bytes: bytes)."""
    return max(1, partition_bytes if plain else partition_bytes // ELEMENT_BYTES)


def itemsize(dtype: str | None) -> int:
    """The bytes of an element of ``dtype`` (plain bytes: 1)."""
    return 1 if dtype is None else parse_dtype(dtype).itemsize


def elements_of(p: Any) -> int | None:
    """How many elements ``p`` holds (plain bytes: bytes); None when its data alone tells.

    Read from its shape, or (without one) the length of its data; pieces
    (``total_bytes``) by the whole's. None too for a shape of more dimensions
    than a parameter may have.
    """
    if p.shape is not None:
        if len(p.shape) > MAX_DIMS:  # (not a shape the store takes: it says so)
            return None
        return math.prod(int(d) for d in p.shape)
    if p.total_bytes is not None:
        return p.total_bytes // itemsize(p.dtype)
    if p.encoding in (None, *_ENCODED_ITEM):
        item = _ENCODED_ITEM.get(p.encoding) or itemsize(p.dtype)
        return memoryview(p.data).nbytes // item
    return None


@dataclass(frozen=True)
class Layout:
    """How a partitioned parameter is cut: its manifest.

    Attributes:
        dtype: its dtype (None: plain bytes).
        shape: its shape (None: one dimension, or as stored: see the IDL's ``shape``).
        elements: how many elements it holds.
        per: the elements of each partition (the last holds the rest).
    """

    dtype: str | None
    shape: tuple[int, ...] | None
    elements: int
    per: int

    @property
    def nbytes(self) -> int:
        """The bytes of the whole, decoded."""
        return self.elements * itemsize(self.dtype)

    @property
    def count(self) -> int:
        """How many partitions."""
        return -(-self.elements // self.per)

    def bounds(self, index: int) -> tuple[int, int]:
        """The flat elements ``[lo, hi)`` partition ``index`` holds."""
        lo = index * self.per
        return lo, min(lo + self.per, self.elements)

    def keys(self, name: str) -> list[str]:
        """The partitions' keys, in order."""
        return [partition_key(name, i) for i in range(self.count)]

    def to_bytes(self) -> bytes:
        shape = None if self.shape is None else list(self.shape)
        return json.dumps(
            {
                "format": FORMAT,
                "dtype": self.dtype,
                "shape": shape,
                "elements": self.elements,
                "per": self.per,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_bytes(cls, data: Any) -> Layout:
        """The layout a manifest's bytes hold.

        Raises:
            ValueError: they are not a manifest this version reads.
        """
        try:
            doc = json.loads(bytes(data))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a partition manifest: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"not a partition manifest of format {FORMAT}")
        dtype, shape, elements, per = (doc.get(k) for k in ("dtype", "shape", "elements", "per"))
        if shape is not None and not isinstance(shape, list):
            raise ValueError("a partition manifest's shape is not a list")
        counts = [elements, per, *(shape or [])]
        if not all(type(v) is int and v >= 0 for v in counts):
            raise ValueError("a partition manifest's sizes are not counts")
        assert isinstance(elements, int) and isinstance(per, int)
        if per < 1:
            raise ValueError("a partition manifest's partitions are empty")
        if dtype is not None and not isinstance(dtype, str):
            raise ValueError("a partition manifest's dtype is not a string")
        if shape is not None and math.prod(shape) != elements:
            raise ValueError("a partition manifest's shape does not hold its elements")
        return cls(dtype, None if shape is None else tuple(shape), elements, per)

    def describe(self) -> str:
        shape = "x".join(map(str, self.shape)) if self.shape else str(self.elements)
        return f"{self.dtype or 'bytes'}[{shape}] in {self.count} partitions of {self.per}"


def layout_for(p: Any, partition_bytes: int) -> Layout | None:
    """The layout to store ``p`` in: None when it is stored whole (or ``partition_bytes`` is 0)."""
    if partition_bytes <= 0:
        return None
    n = elements_of(p)
    per = per_partition(partition_bytes, p.dtype is None)
    if n is None or n <= per:
        return None
    plain = p.dtype is None or p.shape is None  # (plain bytes are one dimension)
    shape = None if plain else tuple(int(d) for d in p.shape)
    return Layout(p.dtype, shape, n, per)


def manifest(p: Any, layout: Layout) -> Any:
    """The manifest ``Parameter`` of ``p`` cut by ``layout`` (its layout, ``p``'s replace)."""
    return thrift.Parameter(
        name=manifest_key(p.name), data=layout.to_bytes(), version=0, replace=p.replace
    )


def split(p: Any, layout: Layout) -> list[Any]:
    """``p`` cut into its partitions (each a ``Parameter`` named by its key; data not copied).

    ``p`` is raw, or encoded elementwise (fp16, bf16, int8, topk: each
    partition encoded so too; decode others first).

    Raises:
        ValueError: ``p`` is encoded otherwise, or its data does not hold
            ``layout.elements`` elements (topk: indices out of order or range).
    """
    encoding = p.encoding
    if encoding not in SPLITTABLE:
        raise ValueError(f"{p.name!r}: {encoding} data is decoded before it is cut")
    data = memoryview(p.data).cast("B")
    indices = values = None
    if encoding == "topk":
        if p.indices is None:
            raise ValueError(f"{p.name!r}: topk needs indices")
        raw_idx = memoryview(p.indices).cast("B")
        if raw_idx.nbytes % 8:
            raise ValueError(f"{p.name!r}: topk indices are not whole int64s")
        indices = np.frombuffer(raw_idx, "<i8")
        item = itemsize(p.dtype)
        if data.nbytes != indices.size * item:
            raise ValueError(f"{p.name!r}: {indices.size} topk indices, {data.nbytes} bytes")
        if indices.size and (
            indices[0] < 0
            or indices[-1] >= layout.elements
            or (indices.size > 1 and not (indices[1:] > indices[:-1]).all())
        ):
            raise ValueError(f"{p.name!r}: topk indices out of order or out of range")
        values = data
    else:
        item = _ENCODED_ITEM[encoding] if encoding else itemsize(p.dtype)
        if data.nbytes != layout.elements * item:
            raise ValueError(
                f"{p.name!r}: {data.nbytes} bytes do not hold {layout.elements} elements"
            )
    parts = []
    for i in range(layout.count):
        lo, hi = layout.bounds(i)
        part = thrift.Parameter(
            name=partition_key(p.name, i),
            data=b"",
            version=p.version,
            dtype=p.dtype,
            shape=None if p.dtype is None else [hi - lo],
            origin=p.origin,
            encoding=encoding,
            scale=p.scale,
            rule=p.rule,
            replace=p.replace,
        )
        if indices is not None:
            assert values is not None
            a, b = np.searchsorted(indices, (lo, hi))
            part.indices = (indices[a:b] - lo).astype("<i8").tobytes()
            part.data = values[a * item : b * item]
        else:
            part.data = data[lo * item : hi * item]
        if hasattr(p, "lossy"):
            part.lossy = p.lossy  # (a gradient's: see ParameterTable.check_gradients)
        parts.append(part)
    return parts


def assemble(name: str, layout: Layout, parts: list[Any], *, join: bool = True) -> Any:
    """The whole ``Parameter`` of its raw partitions (in order).

    Its data is one copy of their bytes, or (not ``join``: an answer to
    send) the partitions' own buffers, to be written one after another
    (:class:`~aioparamsync.wire.writer.Chunks`).

    Its version and origin are the oldest partition's, by (version, origin).

    Raises:
        ValueError: a partition does not hold the elements the layout gives it.
    """
    item = itemsize(layout.dtype)
    for i, part in enumerate(parts):
        lo, hi = layout.bounds(i)
        if memoryview(part.data).nbytes != (hi - lo) * item or part.encoding:
            raise ValueError(f"{name!r}: partition {i} does not hold elements {lo}..{hi}")
    if len(parts) != layout.count:
        raise ValueError(f"{name!r}: {len(parts)} of {layout.count} partitions")
    oldest = min(parts, key=lambda q: (q.version or 0, q.origin or ""))
    return thrift.Parameter(
        name=name,
        data=b"".join(p.data for p in parts) if join else Chunks(p.data for p in parts),
        version=oldest.version,
        dtype=layout.dtype,
        shape=None if layout.shape is None else list(layout.shape),
        origin=oldest.origin,
        rule=parts[0].rule,
    )
