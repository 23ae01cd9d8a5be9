"""What the codec tests share: the general walk, as the reference the fast paths must match."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings

from aioparamsync.errors import RemoteProtocolError
from aioparamsync.wire import codec

# How hard the codec's property tests try.
PROPERTY = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class GeneralReader(codec.BinaryReader):
    """The binary protocol with the general walk only: the reference."""

    __slots__ = ()

    def read_struct(self, cls: Any) -> Any:
        plan = codec._plan(cls)
        self._enter()
        values: dict[str, Any] = {}
        self._read_fields(plan.by_id, values)
        self.depth -= 1
        for name in plan.required:
            if name not in values:
                raise RemoteProtocolError(f"required field {cls.__name__}.{name} is missing")
        return cls(**values)
