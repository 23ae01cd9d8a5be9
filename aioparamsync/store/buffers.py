"""The bytes an entry of the store keeps, and no more of the buffer they came in.

A parameter's data arrives as a view into a frame (with other parameters, or a
part of an update passed on); kept as it is, the whole frame would stay alive as
long as the entry. :func:`kept` decides what an entry keeps; the partitions of one
parameter in one update count together (:func:`partitions_together`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..placement import parse_key

__all__ = ["kept", "partitions_together", "together_of"]


def kept(data: Any, together: int = 0) -> memoryview:
    """``data`` as an entry keeps it: read-only, and keeping no more than its share alive.

    ``together``: the bytes of the same buffer the other partitions of its
    parameter in this update keep (they are replaced together).
    """
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    if not view.readonly:
        # A caller's own buffer could change under the store: keep a copy.
        view = memoryview(bytes(view))
    elif (whole := view.obj) is not None and memoryview(whole).nbytes * 3 > max(
        view.nbytes, together
    ) * 4:
        # A view into a larger buffer (the frame it arrived in, with other
        # parameters, or the parts of an update this node passed on): that
        # buffer would stay alive as long as this entry. Kept alone, so a
        # node holds no more than its share (at most a third more, for the
        # message's own fields, when a parameter came alone in its frame).
        # The partitions of one parameter, every one of which a write or a
        # fold replaces, count together: a node alone keeps its frame.
        view = memoryview(bytes(view))
    return view.toreadonly()


def together_of(together: Mapping[tuple[int, str], int], key: str, data: Any) -> int:
    """What :func:`partitions_together` counts for the parameter of ``key`` in the buffer
    ``data`` is a view of (0: none, or not a partition)."""
    if not together or type(data) is not memoryview or data.obj is None:
        return 0
    parsed = parse_key(key)
    return together.get((id(data.obj), parsed[0]), 0) if parsed is not None else 0


def partitions_together(params: Sequence[Any]) -> dict[tuple[int, str], int]:
    """The bytes of each buffer the partitions of each parameter among ``params`` keep."""
    together: dict[tuple[int, str], int] = {}
    for p in params:
        data = p.data
        if type(data) is memoryview and data.obj is not None and "\x00" in p.name:
            parsed = parse_key(p.name)
            if parsed is not None and parsed[1] is not None:
                key = (id(data.obj), parsed[0])
                together[key] = together.get(key, 0) + data.nbytes
    return together
