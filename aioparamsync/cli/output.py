"""How ``aioparamsync-ctl`` shows what a node answered: text for people, JSON for programs.

Sizes, durations, timestamps and dtypes as a person reads them; columns
padded into a table, ``key  value`` fields, a preview of an array; one JSON
document. None of it talks to a node: :mod:`.ctl`'s commands ask, then print
with these.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..values.arrays import BFLOAT16

__all__ = [
    "format_size",
    "format_duration",
    "format_timestamp",
    "format_table",
    "format_fields",
    "format_preview",
    "dtype_name",
    "print_json",
    "print_parameter",
]

# How much of an array ``get`` shows: this many items at each end of each axis.
PREVIEW_EDGE_ITEMS = 3


def format_size(nbytes: int) -> str:
    """``1536`` -> ``"1.5 KiB"`` (rounded, to read: not a size a flag reads back)."""
    if nbytes < 1024:
        return f"{nbytes} B"
    value = float(nbytes)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} TiB"


def format_duration(seconds: float) -> str:
    """``3725.2`` -> ``"1 h 2 min 5 s"``; under a minute, with a decimal."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    parts: list[str] = []
    rest = int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60), ("s", 1)):
        count, rest = divmod(rest, size)
        if count or parts:
            parts.append(f"{count} {unit}")
    return " ".join(parts)


def format_timestamp(ms: int, parameters: int) -> str:
    """An update timestamp (milliseconds since the epoch, by convention), and its UTC time."""
    if ms == 0:
        # (updates may say 0 themselves: a node holding parameters has had some)
        return "0" if parameters else "0 (no update yet)"
    try:
        when = datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC)
    except (OverflowError, ValueError, OSError):
        return str(ms)  # a client's own timestamps need not be times
    return f"{ms} ({when.isoformat(sep=' ', timespec='milliseconds').replace('+00:00', ' UTC')})"


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]], right: set[int]) -> str:
    """Columns padded to their widest cell; those in ``right`` aligned right."""
    cells = [list(header), *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        padded = [
            c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(row)
        ]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines)


def format_fields(rows: Sequence[tuple[str, Any]], indent: str = "") -> str:
    """One ``key  value`` line a row, the values lined up."""
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"{indent}{key.ljust(width)}  {value}" for key, value in rows)


def format_preview(array: np.ndarray, prefix: str) -> str:
    """A few values from each end of each axis; later lines indented under the first."""
    return np.array2string(
        array, threshold=2 * PREVIEW_EDGE_ITEMS, edgeitems=PREVIEW_EDGE_ITEMS, precision=4,
        max_line_width=100, prefix=prefix,
    )  # fmt: skip


def dtype_name(wire: str | None) -> str:
    """``"<f4"`` -> ``"float32"``; no dtype -> ``"bytes"``."""
    if wire is None:
        return "bytes"
    if wire == BFLOAT16:
        return wire
    try:
        dtype = np.dtype(wire)
    except TypeError:
        return wire  # (a node's dtype string is numpy's; show it as it came)
    return dtype.name if dtype.isnative else wire  # (">f4" is no float32 here)


def print_json(document: Any) -> None:
    print(json.dumps(document, indent=2, allow_nan=False))


def print_parameter(item: dict[str, Any], array: np.ndarray) -> None:
    """What ``get`` prints of one parameter: its name, then its fields and a preview."""
    dtype = f"{array.dtype.name} ({item['dtype']})" if item["dtype"] else "none (plain bytes)"
    shape = tuple(item["shape"]) if item["shape"] is not None else "-"
    rows = [
        ("version", item["version"]),
        ("origin", item["origin"] or "-"),
        ("dtype", dtype),
        ("shape", shape),
        ("bytes", format_size(item["nbytes"])),
        ("value", ""),
    ]
    print(item["name"])
    # The preview goes in the last row; its later lines line up under its first.
    *fields, value = format_fields(rows, indent="  ").splitlines()
    print("\n".join(fields))
    print(value + format_preview(array, prefix=value))
