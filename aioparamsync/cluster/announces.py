"""Announces: what members say of themselves, and what this node tells of the members.

A link's first call announces this node to its peer, which adds it to its
own links and answers the members it knows (itself first); any member new to
this node gets a link too. So a node started with one live member joins the
whole cluster. A member that announces itself under another address moved:
its link follows it (see :meth:`~.membership.Cluster.add`).

What a member says of itself (its state, its epoch) counts only from itself
(:meth:`Announces.said`); what a peer says of others counts until they say
otherwise. A member that said it left is not learned again from others.

A member of another replication factor cannot be in this node's cluster:
placement over the two would differ, and a read through one would miss keys
the other placed. It is refused both ways: its announce is answered with
this node alone, saying why (``Member.refused``), and it is not added; a
link answered so is refused (see ``LinkState.REFUSED``). With a coordinator
the members are etcd's (its config holds the replication factor): announces
change nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ErrorCode, RequestError
from ..placement import LEFT, SELF_STATES, UP
from ..wire import thrift
from .links import LinkState, PeerLink

if TYPE_CHECKING:
    from .membership import Cluster

__all__ = ["Announces"]

log = logging.getLogger(__name__)


class Announces:
    """The cluster's side of the announce exchange (see the module).

    Args:
        cluster: the cluster whose members they are.
    """

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._departed: set[str] = set()  # ids of members that left (not learned again)
        #: what each member says it claims, and is claiming (see aioparamsync.placement)
        self.claims: dict[str, dict[str, int]] = {}
        self.claiming: dict[str, dict[str, int]] = {}

    def announcement(self, refused: str | None = None) -> Any:
        """This node as it announces itself: where it is, its state, epoch and
        replication factor (``refused``: why it refuses the member it answers)."""
        cluster = self.cluster
        me = cluster.me
        return thrift.Member(
            node_id=me.node_id,
            host=me.host,
            port=me.port,
            state=cluster.state,
            epoch=cluster.epoch,
            replication_factor=cluster.replication_factor or 0,
            refused=refused,
            claims=dict(cluster.claims),
            claiming=dict(cluster.claiming),
        )

    def refusal(self, member: Any) -> str | None:
        """Why ``member`` and this node cannot be in one cluster (None: they can): it
        says it refused this node, or it says another replication factor."""
        if member.refused:
            return str(member.refused)
        theirs, mine = member.replication_factor, self.cluster.replication_factor
        if theirs is None or (theirs or None) == mine:
            return None  # (the same; or a node that does not say)
        return (
            f"node {member.node_id} has replication factor {theirs or 'all'}, node "
            f"{self.cluster.me.node_id} {mine or 'all'}: the nodes of one cluster "
            "share one (start them with the same --replication-factor)"
        )

    def members(self) -> list[Any]:
        """Every member known, this node first."""
        known = [
            thrift.Member(
                node_id=link.node_id,
                host=link.host,
                port=link.port,
                state=link.member_state or UP,
                claims=self.claims.get(link.node_id),
                claiming=self.claiming.get(link.node_id),
            )
            for link in self.cluster.links.values()
            if link.node_id and link.state != LinkState.REFUSED
        ]
        return [self.announcement(), *known]

    def topology(self) -> Any:
        """The cluster as this node sees it (the IDL's ``Topology``)."""
        cluster = self.cluster
        me = cluster.me
        members = [
            thrift.TopologyMember(
                node_id=me.node_id, host=me.host, port=me.port, state=cluster.state
            )
        ]
        members += [
            thrift.TopologyMember(
                node_id=link.node_id,
                host=link.host,
                port=link.port,
                state=cluster.seen_state(link),
            )
            for link in cluster.links.values()
            if link.node_id and link.state != LinkState.REFUSED
        ]
        return thrift.Topology(
            epoch=cluster.epoch,
            members=members,
            replication_factor=cluster.replication_factor or 0,
            partition_bytes=0,  # (the node's service answers its own: see server.handlers)
            acks=cluster.acks,
            claims=dict(cluster.placement.claims) or None,
        )

    def announced(self, member: Any) -> list[Any]:
        """A peer announced itself: add it; answer the members this node knows.

        Raises:
            RequestError: (BAD_REQUEST) ``member`` is not one.
        """
        if not member.node_id or not member.host or not 0 < member.port < 65536:
            raise RequestError(
                ErrorCode.BAD_REQUEST, f"a member needs an id, a host and a port: {member}"
            )
        if member.state is not None and member.state not in SELF_STATES:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"a member's state is one of {', '.join(sorted(SELF_STATES))}, not "
                f"{member.state!r}",
            )
        if member.replication_factor is not None and member.replication_factor < 0:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                "a member's replication factor is at least 1, or 0 (every node holds every "
                f"key), not {member.replication_factor}",
            )
        if member.refused is not None:
            raise RequestError(
                ErrorCode.BAD_REQUEST, "refused is for an answer to announce, not an announce"
            )
        cluster = self.cluster
        why = self.refusal(member)
        if why is not None:
            cluster.add_refused(member.host, member.port, member.node_id, why)
            return [self.announcement(refused=why)]
        link = cluster.add(member.host, member.port, member.node_id, itself=True)
        if link is not None:
            self.said(link, member)
        cluster.refresh()
        return self.members()

    def learn(self, members: Sequence[Any], peer: PeerLink | None = None) -> None:
        """Members a peer answered (``peer``: the link it answered on; it is the first)."""
        cluster = self.cluster
        if cluster.coordinator is not None:
            return  # (the members are etcd's)
        for i, member in enumerate(members):
            if i == 0 and peer is not None:
                self.said(peer, member)
            elif member.node_id not in self._departed:
                link = cluster.add(member.host, member.port, member.node_id)
                if link is not None and link.member_state is None and member.state:
                    # (what it said of itself to the peer: until it tells this node)
                    link.member_state = member.state if member.state in SELF_STATES else UP
                    self._claims_of(member)
        cluster.refresh()

    def said(self, link: PeerLink, member: Any) -> None:
        """What a member said of itself (its state, its epoch), directly.

        A member bumps its epoch whenever its own state changes, before it
        says so: of two of its reports, the one with the smaller epoch is the
        older (an answer to an announce can arrive after the member's next
        announce, on another connection), and changes nothing. A larger epoch
        than this node's is adopted (so epochs only grow, cluster-wide, as
        Redis Cluster's configEpoch).
        """
        cluster = self.cluster
        if cluster.coordinator is not None:
            return  # (the members are etcd's)
        if member.epoch is not None:
            if link.said_epoch is not None and member.epoch < link.said_epoch:
                return
            link.said_epoch = member.epoch
        state = member.state if member.state in SELF_STATES else UP  # (a node of old: up)
        self._claims_of(member)
        if link.member_state != state:
            link.member_state = state
            if state == LEFT:
                self._departed.add(member.node_id)
                log.info("member %s left the cluster", link.name)
        if state != LEFT:
            self._departed.discard(member.node_id)
        if member.epoch is not None and member.epoch > cluster.epoch:
            cluster.view = cluster.view.at(member.epoch)

    def _claims_of(self, member: Any) -> None:
        """What ``member`` claims and is claiming, as it says (a node of old: nothing)."""
        node_id = member.node_id
        for said, known in ((member.claims, self.claims), (member.claiming, self.claiming)):
            if said:
                known[node_id] = {k: int(v) for k, v in said.items() if isinstance(k, str)}
            else:
                known.pop(node_id, None)
