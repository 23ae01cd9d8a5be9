"""Anti-entropy: a link pulls what its peer holds newer than this node.

Oneway messages can be lost (a connection that breaks mid-send, a node that
restarts empty), so links also repair: on every (re)connection, every
``repair_interval`` seconds and at every new epoch, a link asks its peer for
the digest (name -> version, origin) of the keys this node is a replica of,
by the placement it sends (the one it will have, while joining), and pulls
whatever the peer has newer than this node. Every node does the same towards
each of its peers, so every replica ends equal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..client.fetch import fetch
from ..placement import LEAVING
from ..store.table import lww_key
from ..wire import METHODS, thrift
from .batches import batches

if TYPE_CHECKING:
    from ..client.api import ParameterClient
    from .membership import Cluster

__all__ = ["repair"]


async def repair(cluster: Cluster, client: ParameterClient, peer: str) -> int:
    """Pull from ``client``'s node (member ``peer``) what it holds newer than this node,
    of what this node holds; answer how many parameters were pulled."""
    if cluster.state == LEAVING:
        return 0  # it holds nothing any more: it hands off
    if not cluster.fencing.trusted(peer):
        return 0  # (a member whose lease expired: what it holds may lose acknowledged writes)
    placement = cluster.pending or cluster.placement
    request = thrift.DigestRequest(
        for_node=cluster.me.node_id,
        members=list(placement.members),
        replication_factor=placement.r or 0,
        claims=dict(placement.claims) or None,
    )
    digest = await client.invoke(METHODS.digest_for, request=request)
    table = cluster.store.table
    wanted = []
    for item in digest:
        mine = table.entry(item.name)
        if mine is None or lww_key(mine) < lww_key(item):
            wanted.append(item)
    pulled = 0
    for batch in batches(wanted, cluster.batch_params, cluster.batch_bytes):
        request = thrift.ParameterRequest(
            param_names=[item.name for item in batch],
            max_inline_bytes=cluster.inline_bytes,
            as_stored=True,  # (what the peer stores: never passed on, see the IDL)
        )
        response = await client.invoke(METHODS.pull_parameters, request=request)
        # A large parameter comes without its data: read it in pieces.
        params = [
            p
            if p.total_bytes is None
            else await fetch(client, p, cluster.piece_bytes, as_stored=True)
            for p in response.params
        ]
        if params:
            await cluster.store.update(params, response.timestamp, replicated=True)
            pulled += len(params)
    return pulled
