"""Digests: what a node holds, name -> (version, origin, size), for anti-entropy.

A peer compares a digest with what it holds and pulls what is newer (see
:mod:`aioparamsync.cluster.repair`); ``digest_for`` answers only the keys a
given member holds by a given placement (the one it will have, while it
joins), or only the names asked for (a hand-off checking what its target has).
``lift`` raises keys' versions at their primary, then answers their digest (a
node back with its data asks it: see :mod:`aioparamsync.cluster.recovered`).
``digest`` may also answer the buckets of embedding tables held here, with the
bytes of their rows: placement balanced by bytes counts them with the keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import ErrorCode, RequestError
from ..placement import LEAVING, LEFT, LIVE, Placement, bucket_key
from ..store.rows import RowTables
from ..store.table import ParameterTable
from ..store.writer import ParameterStore
from ..wire import thrift

if TYPE_CHECKING:
    from .clusterview import ClusterView

__all__ = ["bucket_digest", "digest", "digest_for", "lift"]


def _entry(table: ParameterTable, name: str) -> Any:
    e = table.entry(name)
    assert e is not None
    recovered = True if table.recovered and table.recovered_entry(name) is not None else None
    return thrift.DigestEntry(
        name=e.name, version=e.version, origin=e.origin, nbytes=e.nbytes, recovered=recovered
    )


def digest(table: ParameterTable) -> list[Any]:
    """Every key held (the IDL's ``digest``)."""
    return [_entry(table, name) for name in table.names()]


def bucket_digest(tables: RowTables) -> list[Any]:
    """Every bucket of an embedding table held here with rows, as the IDL's ``digest``
    answers it when asked for ``buckets``: its placement key and its rows' bytes."""
    return [
        thrift.DigestEntry(
            name=bucket_key(t.spec.name, bucket),
            version=0,
            origin="",
            nbytes=len(block) * t.spec.dim * t.spec.dtype.itemsize,
        )
        for t in list(tables.tables.values())
        for bucket, block in list(t.blocks.items())
        if len(block)
    ]


def digest_for(
    store: ParameterStore, request: Any, cluster: ClusterView | None = None
) -> list[Any]:
    """The keys ``request`` asks of (the IDL's ``DigestRequest``): those named, or
    those its ``for_node`` holds by its ``members`` and ``replication_factor``.

    Asked by a hand-off (``handing``: the caller drops what this answers), of those
    only the keys this node will hold by its own view (``cluster``), and none while
    it leaves or has left. A caller whose view is behind may take this node for a
    holder it no longer is: a leaving node that handed a key on already, or one a
    claim took the key from. Were the key answered, the caller would drop it too,
    and it would be gone once this node drops or leaves with its own copy; not
    answered, the caller keeps it until its view shows where the key goes.

    Raises:
        RequestError: (BAD_REQUEST) a request that is missing or does not hold together,
            (LIMIT_EXCEEDED) too many names.
    """
    if request is None:
        raise RequestError(ErrorCode.BAD_REQUEST, "the request is missing")
    table = store.table
    if request.names is not None:
        store.read(request.names)  # (checks the request's size)
        names = [n for n in dict.fromkeys(request.names) if n in table]
    else:
        names = table.names()
    if request.for_node is not None:
        if not request.members or request.for_node not in request.members:
            raise RequestError(ErrorCode.BAD_REQUEST, "digest_for: for_node must be one of members")
        r = request.replication_factor or None
        if r is not None and r < 0:
            raise RequestError(ErrorCode.BAD_REQUEST, "replication_factor must not be negative")
        placement = Placement(request.members, r, request.claims)
        names = [n for n in names if placement.holds(request.for_node, n)]
    if request.handing and cluster is not None:
        if cluster.state in (LEAVING, LEFT):
            return []
        names = [n for n in names if cluster.holds_here(n)]
    return [_entry(table, n) for n in names]


async def lift(store: ParameterStore, cluster: ClusterView | None, request: Any) -> list[Any]:
    """Raise the versions of the keys named in ``request`` (the IDL's ``LiftRequest``)
    that this node is the primary of (every key, alone) to their floors, where lower,
    then answer the digest of those it holds: the caller sees which reached their floor.
    A node neither up nor leaving (a leaving one is still its keys' primary), fenced,
    or not their primary (by its own view) leaves them as they are; while it takes
    over as a primary, the lift waits until it has.

    Raises:
        RequestError: (BAD_REQUEST) no floors, or a floor below 1; (LIMIT_EXCEEDED)
            too many keys.
    """
    floors = request.floors if request is not None else None
    if floors is None:
        raise RequestError(ErrorCode.BAD_REQUEST, "lift: the floors are missing")
    names = list(floors)
    store.read(names)  # (checks the request's size)
    if any(floor < 1 for floor in floors.values()):
        raise RequestError(ErrorCode.BAD_REQUEST, "lift: a floor must be at least 1")
    mine = floors
    if cluster is not None:
        if cluster.settling is not None:
            await cluster.settling
        me, placement, live = cluster.me.node_id, cluster.placement, cluster.live
        may = cluster.state in LIVE and cluster.fenced() is None
        mine = {n: f for n, f in floors.items() if may and placement.primary(n, live) == me}
    await store.lift(mine)
    return digest_for(store, thrift.DigestRequest(names=names))
