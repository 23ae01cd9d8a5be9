"""A small read answered whole in C (``server/_cread.pyx``): when the node may, and how.

A ``get_parameters`` or ``pull_parameters`` of a few small values the node holds is
answered from its request's bytes to its reply's in one compiled call, the reply the
Python path (``ParameterService._pull``, then ``encode_message``) makes, byte for byte;
any other read, and any read while the node is starting or has peers (a read may be
routed elsewhere), is the Python path's. The connection calls it for a read that is owed
nothing before it (see ``CallDispatch._dispatch``). ``tests/test_fast_read.py`` holds the two
paths equal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._ext import compiled
from ..wire.binary import BinaryWriter

if TYPE_CHECKING:
    from .handlers import ParameterService

__all__ = ["FastRead", "fast_reader"]

_cread = compiled("server._cread")

#: the framed reply to a read's payload, and whether it is a ``pull_parameters``; or None
FastRead = Callable[[Any], "tuple[bytes, bool] | None"]


def rule_bytes(rule: Any) -> bytes:
    """A rule's struct as the writer writes it in a ``Parameter`` (its fields and STOP)."""
    writer = BinaryWriter()
    writer.write_struct(rule)
    parts, _ = writer.getvalue()
    return b"".join(parts)


def may_answer(service: ParameterService) -> bool:
    """Whether ``service`` may answer a read so: it is up, and alone (nothing is routed)."""
    return service.starting is None and service.router.alone()


def fast_reader(service: ParameterService) -> FastRead | None:
    """``service``'s fast read, or None where the compiled path is not built. (Compiled
    whole: a call that is no read is told so in C, before any of this module's Python.)"""
    if _cread is None:
        return None
    return _cread.FastRead(service, may_answer, rule_bytes)
