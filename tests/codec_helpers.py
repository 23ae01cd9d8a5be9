"""What the codec tests share: the general walk, as the reference the fast paths must match."""

from __future__ import annotations

import struct
from typing import Any

from hypothesis import HealthCheck, settings

from aioparamsync.errors import RemoteProtocolError
from aioparamsync.wire import NeedData
from aioparamsync.wire.binary import BinaryReader
from aioparamsync.wire.plan import _plan

# How hard the codec's property tests try.
PROPERTY = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class GeneralReader(BinaryReader):
    """The binary protocol with the general walk only: the reference."""

    __slots__ = ()

    def read_struct(self, cls: Any) -> Any:
        plan = _plan(cls)
        self._enter()
        values: dict[str, Any] = {}
        self._read_fields(plan.by_id, values)
        self.depth -= 1
        for name in plan.required:
            if name not in values:
                raise RemoteProtocolError(f"required field {cls.__name__}.{name} is missing")
        return cls(**values)


def plain(value: Any) -> Any:
    if isinstance(value, memoryview):
        return ("view", bytes(value), value.readonly)
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    spec = getattr(value, "thrift_spec", None)
    if spec is not None:
        return type(value).__name__, {f[1]: plain(getattr(value, f[1])) for f in spec.values()}
    if isinstance(value, float) and value != value:
        return ("nan", struct.pack("<d", value))  # (NaN equals no NaN: compare its bits)
    return value


def mutate(data: bytes, cut: int | None, flips: list[tuple[int, int]]) -> bytes:
    """``data`` with each ``(where, xor)`` of ``flips`` applied, then cut at ``cut``."""
    buf = bytearray(data)
    for where, xor in flips:
        if buf:
            buf[where % len(buf)] ^= xor
    if cut is not None:
        del buf[cut % (len(buf) + 1) :]
    return bytes(buf)


def outcome(reader_cls: type, data: bytes, cls: type, stream: bool) -> Any:
    """What decoding ``data`` (a message) as ``cls`` gives: a value or the error."""
    reader = reader_cls(data, stream=stream, limit=1 << 20)
    try:
        reader.read_message_begin()
        body = reader.read_body(cls)
    except RemoteProtocolError as exc:
        return ("RemoteProtocolError", str(exc))
    except NeedData as exc:
        return ("NeedData", exc.needed)
    return plain(body), reader.pos, reader.elements
