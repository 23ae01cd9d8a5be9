"""Small calls answered in C (``server/_csmall.pyx``): when the node may, and how.

A read of a few small values the node holds (``get_parameters``, ``pull_parameters``) and
a founding client's ``update_parameters`` of small values are answered from the request's
bytes to the reply's in one compiled call, equal to what the Python path makes of them
(for an update, the same entries, stored and fed to the store's subscribers as the
writer does); any other call, and any while the node may not answer so, is the Python
path's. The connection calls it for a call owed nothing before it (see
``CallDispatch._dispatch``). ``tests/test_small_calls.py`` holds the two paths equal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._ext import compiled
from ..store.table import Entry
from ..wire.binary import BinaryWriter

if TYPE_CHECKING:
    from .handlers import ParameterService

__all__ = ["FastCall", "fast_calls"]

_csmall = compiled("server._csmall")
_centry = compiled("store._centry")

#: the framed reply to a call's payload, and its method's name; or None
FastCall = Callable[[Any], "tuple[bytes, str] | None"]


def rule_bytes(rule: Any) -> bytes:
    """A rule's struct as the writer writes it in a ``Parameter`` (its fields and STOP)."""
    writer = BinaryWriter()
    writer.write_struct(rule)
    parts, _ = writer.getvalue()
    return b"".join(parts)


def may_read(service: ParameterService) -> bool:
    """Whether ``service`` may answer a read so: it is up, and alone (nothing is routed)."""
    return service.starting is None and service.router.alone()


def may_write(service: ParameterService) -> bool:
    """Whether ``service`` may apply an update so: as for a read, and it takes writes (no
    follower), unfenced (no coordinator), holds no parameter as partitions, and its
    writer would apply the update next, alone (see ``ParameterStore.idle``)."""
    cluster = service.cluster
    store = service.store
    return (
        service.starting is None
        and service.following is None
        and service.router.alone()
        and (cluster is None or cluster.coordinator is None)
        and not store.table.holds_manifests
        and store.idle()
    )


def fast_calls(service: ParameterService) -> FastCall | None:
    """``service``'s small calls in C, or None where the compiled path is not built.
    (A call that is none of them is told so in C, before any of this module's Python.)"""
    if _csmall is None or _centry is None:
        return None
    return _csmall.FastCalls(service, may_read, may_write, rule_bytes, _centry.EntryMaker(Entry))
