"""A member as it is kept in etcd (see :mod:`.coordinator`): its address, its state and
what it claims.

The value of ``PREFIX/members/NODE_ID`` is JSON: ``host``, ``port``, ``state`` and, while
it claims keys (placement balanced by bytes: see :mod:`.balance`), ``claims`` and
``claiming`` (key -> the epoch it claimed it at). With a coordinator a claim is a write
of the claimer's own record, so every node sees it on its own watch, at one revision: the
epoch. A record that is not one is ignored (logged), and a record without claims (a node
of an older version) claims nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..placement import SELF_STATES

__all__ = ["Record"]

log = logging.getLogger(__name__)

_NONE: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True)
class Record:
    """A member as it is in etcd."""

    node_id: str
    host: str
    port: int
    state: str
    claims: Mapping[str, int] = field(default_factory=lambda: _NONE, hash=False)
    claiming: Mapping[str, int] = field(default_factory=lambda: _NONE, hash=False)

    def encode(self) -> bytes:
        fields: dict[str, Any] = {"host": self.host, "port": self.port, "state": self.state}
        if self.claims:
            fields["claims"] = dict(self.claims)
        if self.claiming:
            fields["claiming"] = dict(self.claiming)
        return json.dumps(fields).encode()

    def with_state(
        self,
        state: str,
        claims: Mapping[str, int] | None = None,
        claiming: Mapping[str, int] | None = None,
    ) -> Record:
        """This record in ``state``, with ``claims`` and ``claiming`` (None: as they are)."""
        return Record(
            self.node_id,
            self.host,
            self.port,
            state,
            self.claims if claims is None else MappingProxyType(dict(claims)),
            self.claiming if claiming is None else MappingProxyType(dict(claiming)),
        )

    @classmethod
    def decode(cls, node_id: str, raw: bytes) -> Record | None:
        """A member's key's value, or None (logged) when it is not one."""
        try:
            fields = json.loads(raw)
            record = cls(
                node_id,
                str(fields["host"]),
                int(fields["port"]),
                str(fields["state"]),
                _claims(fields.get("claims")),
                _claims(fields.get("claiming")),
            )
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("member %s in etcd is not one (%s): ignored", node_id, exc)
            return None
        if record.state not in SELF_STATES or not 0 < record.port < 65536:
            log.warning("member %s in etcd is not one (%r): ignored", node_id, raw[:200])
            return None
        return record


def _claims(value: Any) -> Mapping[str, int]:
    # (key -> epoch; absent: none. Anything else is no record: ValueError)
    if value is None:
        return _NONE
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and type(v) is int for k, v in value.items()
    ):
        raise ValueError(f"claims are a map of keys to epochs, not {str(value)[:100]}")
    return MappingProxyType(value)
