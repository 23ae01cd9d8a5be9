"""The writer: a message encoded into a list of buffers, large binaries by reference.

``binary`` fields encode by reference: the encoder returns a list of buffers
for a vectored write, the large ones being the caller's own. :class:`Writer`
holds those buffers and the general walk, driven by each struct class's plan;
the protocols' primitives are its subclasses' (:mod:`.binary`,
:mod:`.compact`). A value that cannot be encoded raises
:class:`~aioparamsync.errors.LocalProtocolError`.
"""

from __future__ import annotations

from typing import Any

from ..errors import LocalProtocolError
from .plan import _PLANS, _plan
from .protocol import _T_BYTES, _T_MAP, _T_SEQUENCES, _T_STRUCT, MAX_I32

__all__ = ["Writer"]

# Binary fields at least this long are sent by reference instead of being
# copied into the encoder's buffer (a copy is cheaper than a separate iovec
# for small ones).
ZERO_COPY_MIN_BYTES = 16 * 1024


class Chunks(tuple):
    """Buffers written one after another as one ``binary`` value, none of them copied.

    (A read of a parameter stored as partitions is answered so: its bytes are
    the partitions' own, as they are stored.)
    """

    __slots__ = ()

    @property
    def nbytes(self) -> int:
        return sum(memoryview(chunk).nbytes for chunk in self)


def _as_bytes_view(value: Any) -> memoryview:
    view = value if isinstance(value, memoryview) else memoryview(value)
    if view.ndim != 1 or view.format != "B":
        try:
            view = view.cast("B")
        except TypeError as exc:
            raise LocalProtocolError(f"binary value must be a C-contiguous buffer: {exc}") from None
    elif not view.c_contiguous:
        raise LocalProtocolError("binary value must be a C-contiguous buffer")
    return view


class Writer:
    """Encodes into a list of buffers: its own bytes, and large binaries by reference."""

    __slots__ = ("out", "parts", "size")

    def __init__(self) -> None:
        self.out = bytearray()
        self.parts: list[Any] = []
        self.size = 0  # bytes in parts (not counting out)

    def _write_view(self, view: memoryview) -> None:
        if len(view) >= ZERO_COPY_MIN_BYTES:
            if self.out:
                self.parts.append(self.out)
                self.size += len(self.out)
                self.out = bytearray()
            self.parts.append(view)
            self.size += len(view)
        else:
            self.out += view

    def _write_chunks(self, value: Chunks) -> None:
        views = [_as_bytes_view(chunk) for chunk in value]
        n = sum(len(view) for view in views)
        if n > MAX_I32:
            raise LocalProtocolError(f"a value of {n} bytes exceeds Thrift's 2 GiB")
        self._write_length(n)
        for view in views:
            self._write_view(view)

    def getvalue(self) -> tuple[list[Any], int]:
        """Answer (buffers, total length)."""
        parts = self.parts
        if self.out:
            parts.append(self.out)
        return parts, self.size + len(self.out)

    # -- per protocol ---------------------------------------------------------

    def write_message_begin(self, name: str, mtype: int, seqid: int) -> None:
        raise NotImplementedError

    def _field_begin(self, ttype: int, fid: int, value: Any) -> bool:
        """Write a field header; answer True where it carried the value."""
        raise NotImplementedError

    def _field_stop(self) -> None:
        raise NotImplementedError

    def _struct_begin(self) -> None:
        pass

    def _struct_end(self) -> None:
        pass

    def _list_begin(self, etype: int, count: int) -> None:
        raise NotImplementedError

    def _map_begin(self, ktype: int, vtype: int, count: int) -> None:
        raise NotImplementedError

    def _write_scalar(self, ttype: int, value: Any) -> None:
        raise NotImplementedError

    def _write_length(self, n: int) -> None:
        raise NotImplementedError

    # -- the walk ---------------------------------------------------------------

    def write_struct(self, obj: Any) -> None:
        cls = type(obj)
        plan = _PLANS.get(cls) or _plan(cls)
        self._struct_begin()
        for name, fid, ttype, sub, required, _ in plan.in_order:
            value = getattr(obj, name, None)
            if value is None:
                if required:
                    raise LocalProtocolError(f"required field {cls.__name__}.{name} is missing")
                continue
            if not self._field_begin(ttype, fid, value):
                self._write_value(ttype, sub, value)
        self._field_stop()
        self._struct_end()

    def _write_value(self, ttype: int, sub: Any, value: Any) -> None:
        """Write a value of spec type ``ttype`` (``sub``: its normalised sub-spec)."""
        if ttype in _T_BYTES:
            if type(value) is Chunks:
                self._write_chunks(value)
                return
            if isinstance(value, str):
                value = value.encode("utf-8")
            view = _as_bytes_view(value)
            if len(view) > MAX_I32:
                raise LocalProtocolError(f"a value of {len(view)} bytes exceeds Thrift's 2 GiB")
            self._write_length(len(view))
            self._write_view(view)
        elif ttype == _T_STRUCT:
            self.write_struct(value)
        elif ttype in _T_SEQUENCES:
            etype, esub, ewire = sub
            items = list(value)
            self._list_begin(ewire, len(items))
            for item in items:
                self._write_value(etype, esub, item)
        elif ttype == _T_MAP:
            ktype, ksub, kwire, vtype, vsub, vwire = sub
            self._map_begin(kwire, vwire, len(value))
            for key, item in value.items():
                self._write_value(ktype, ksub, key)
                self._write_value(vtype, vsub, item)
        else:
            self._write_scalar(ttype, value)
