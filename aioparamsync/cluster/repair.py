"""Anti-entropy: a link pulls what its peer holds newer than this node.

Oneway messages can be lost (a connection that breaks mid-send, a node that
restarts empty), so links also repair: on every (re)connection, every
``repair_interval`` seconds and at every new epoch, a link asks its peer for
the digest (name -> version, origin) of the keys this node is a replica of,
by the placement it sends (the one it will have, while joining), and pulls
whatever the peer has newer than this node. Every node does the same towards
each of its peers, so every replica ends equal. (A copy a node read from its
data directory at start, written to by nothing since, does not win over a
live one: see :mod:`.recovered`.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..placement import LEAVING, LEFT
from ..wire import METHODS, thrift

if TYPE_CHECKING:
    from ..client.api import ParameterClient
    from .membership import Cluster

__all__ = ["repair"]


async def repair(cluster: Cluster, client: ParameterClient, peer: str) -> int:
    """Pull from ``client``'s node (member ``peer``) what it holds newer than this node,
    of what this node holds; answer how many parameters were pulled."""
    if cluster.state in (LEAVING, LEFT):
        return 0  # it holds nothing any more: it hands off, or has left
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
    # (what it holds newer, and what supersedes copies from before a restart)
    return await cluster.recovery.pull(client, peer, digest)
