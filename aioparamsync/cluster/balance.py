"""Balance by bytes: a member that is primary of less than its share claims keys.

Hashing spreads keys, not bytes (see :mod:`aioparamsync.placement`): with few,
unequal tensors one member is primary of far more bytes than another, and it
sets every step's pace. So each member, every ``interval`` seconds (with a
jitter) while the cluster is steady (every member up, none joining, leaving
or claiming, no epoch change in the round), runs a round:

1. it asks every member for its digest (each key it holds, with its bytes, and
   each bucket of an embedding table it holds rows of, with their bytes):
   together, the keys of the cluster and their sizes;
2. it counts each member's load, the bytes of the keys it is primary of;
3. if its own load is below the mean, it picks keys whose primary is above the
   mean by more than twice ``SLACK`` (or above the mean at all, when this
   member is below it by more than ``SLACK``), largest first, each one only if it leaves
   this member at most ``SLACK`` above the mean and the member it comes from
   at most ``SLACK`` below (so no move makes another one needed back); and,
   while it is below the mean, any key that *evens it out* with a member more
   than ``GAIN`` above the mean: this member ends ``GAIN`` of the mean below that
   member's load before at least, and that member not below the slack (each such
   move lowers the sum of the loads' squares, and none takes a member below the
   slack, so rounds end);
4. it claims them (:meth:`.Transitions.claim`: pulled first, then its own;
   nothing moves but toward the claimer, and a key moves as at a join).

Only members below the mean act, each for itself, so a round moves bytes
toward those that have too few, and about their shortfall: few large keys and
many small ones alike come within ``SLACK`` of the mean (a key larger than the
slack moves whole, or not at all), and then as near it as whole keys allow: the
fullest member ends within ``GAIN`` of the mean, or none of its keys evens it
out with a member below the mean. (With 4 MiB keys, each 8% of a member's share,
``SLACK`` alone left a model's fullest member 8% above the mean.) Claims of keys
no longer held anywhere
are dropped at the next claim. A member joining takes its rendezvous share,
then claims the rest of its share. Claims are only this member's word, told
with its state: one that restarts claims nothing until its next round.

A bucket of rows is a key like any other here: claimed, it moves as at a join
(the claimer pulls its rows as it settles: see
:class:`~aioparamsync.server.bucketmoves.BucketMoves`), so a table's rows end
balanced with the rest of the bytes.

With a coordinator, claims are in each member's record in etcd (see
:mod:`.records`): a claim is a write there, seen by every node at one revision.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import ParamSyncError
from ..placement import UP, placed_by
from ..wire import METHODS
from .links import LinkState

if TYPE_CHECKING:
    from .membership import Cluster

__all__ = ["DEFAULT_BALANCE_INTERVAL", "GAIN", "MAX_CLAIMS", "SLACK", "Balancer", "plan"]

log = logging.getLogger(__name__)

# Seconds between two rounds (each with a jitter of up to a half more); 0: never.
DEFAULT_BALANCE_INTERVAL = 10.0
# How far from the mean a member's load may be (a fraction of it).
SLACK = 0.05
# How far above the mean a member may stay before one below the mean evens the two
# out, and how far below its load before the taker ends at least (a fraction of the
# mean; see the module, step 3).
GAIN = 0.02
# The most keys a member claims.
MAX_CLAIMS = 10_000
# The most keys a round looks at (past it, no round: the digests would be too large).
MAX_KEYS = 500_000


def plan(
    me: str, sizes: dict[str, int], primary_of: dict[str, str], members: list[str]
) -> list[str]:
    """The keys ``me`` is to claim (see the module, step 3).

    Args:
        sizes: each key's bytes.
        primary_of: each key's primary now.
        members: the members placed and up, ``me`` among them.
    """
    load = dict.fromkeys(members, 0)
    for key, size in sizes.items():
        owner = primary_of.get(key)
        if owner in load:
            load[owner] += size
    mean = sum(load.values()) / len(members)
    low, high, over = mean * (1 - SLACK), mean * (1 + SLACK), mean * (1 + 2 * SLACK)
    if not mean or load[me] >= mean:
        return []
    if load[me] >= low and any(load[m] < low for m in members):
        return []  # (the members short by more than the slack take first: after a join, it)

    even = mean * (1 + GAIN)
    least = mean * GAIN

    def gives(donor: str) -> bool:
        # (a member above twice the slack gives to any below the mean; one above the
        # mean only to one below the slack: a join's smaller mean moves few keys)
        return load[donor] > over or (load[donor] > mean and load[me] < low)

    def takes(size: int, donor: str) -> bool:
        if load[donor] - size < low:
            return False
        if gives(donor) and load[me] + size <= high:
            return True
        # (or, below the mean still, it evens the two out: it ends `least` below the
        # donor's load before at least, which lowers the sum of the loads' squares)
        return load[me] < mean < even < load[donor] and load[me] + size <= load[donor] - least

    candidates = sorted(
        (k for k, owner in primary_of.items() if owner != me and load[owner] > mean),
        key=lambda k: (-sizes[k], k),
    )
    chosen = []
    for key in candidates:
        size, donor = sizes[key], primary_of[key]
        if takes(size, donor):
            chosen.append(key)
            load[me] += size
            load[donor] -= size
    return chosen


class Balancer:
    """Runs the rounds of this member (see the module).

    Args:
        cluster: the cluster whose member this node is.
        interval: seconds between rounds (0: no rounds).
    """

    def __init__(self, cluster: Cluster, interval: float = DEFAULT_BALANCE_INTERVAL) -> None:
        self.cluster = cluster
        self.interval = interval
        self.rounds = 0
        self.claimed = 0  # keys claimed, so far
        # The buckets of rows this node holds, as its digest answers them (set by the
        # node: its tables are the server's; none without).
        self.buckets_here: Callable[[], list[Any]] = list
        self._task: asyncio.Task[None] | None = None

    def statistics(self) -> dict[str, int]:
        """For ``info()``'s counters: rounds run, keys claimed so far, now claimed and
        being claimed by this member."""
        cluster = self.cluster
        return {
            "balance_rounds": self.rounds,
            "keys_claimed": self.claimed,
            "claims": len(cluster.claims),
            "keys_claiming": len(cluster.claiming),
        }

    def start(self) -> None:
        if self.interval > 0:
            self._task = asyncio.create_task(self._run(), name="aioparamsync-balance")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval * (1 + random.random() / 2))
            try:
                await self.round()
            except (ParamSyncError, OSError) as exc:
                log.info("balance round given up: %s", exc)
            except Exception:  # a bug must not stop balancing for good
                log.exception("balance round failed")

    def _steady(self) -> bool:
        cluster = self.cluster
        view = cluster.view
        return (
            cluster.state == UP
            and view.pending is None
            and not cluster.claiming
            and cluster.settling is None
            and all(s == UP for s in view.states.values())
            and all(link.state == LinkState.UP for link in cluster.by_id.values())
        )

    async def round(self) -> int:
        """One round (see the module); answers how many keys it claimed."""
        cluster = self.cluster
        self.rounds += 1  # (a round that finds the cluster changing claims nothing)
        if not self._steady() or not cluster.by_id:
            return 0
        epoch = cluster.epoch
        links = list(cluster.by_id.values())
        digests = await asyncio.gather(
            *(link.proxy().invoke(METHODS.digest, buckets=True) for link in links)
        )
        table = cluster.store.table
        sizes: dict[str, int] = {}
        for name in table.names():
            entry = table.entry(name)
            if entry is not None:
                sizes[name] = entry.nbytes
        for digest in [self.buckets_here(), *digests]:
            for item in digest or ():
                sizes[item.name] = max(sizes.get(item.name, 0), item.nbytes)
            if len(sizes) > MAX_KEYS:
                return 0
        if cluster.epoch != epoch or not self._steady():
            return 0
        view = cluster.view
        me = cluster.me.node_id
        placement = view.placement
        primary_of = {}
        for key in sizes:
            owner = placement.primary(key, view.live)
            if owner is not None:
                primary_of[key] = owner
        members = [m for m in placement.members if m in view.live]
        chosen = plan(me, sizes, primary_of, members)
        # (claims are by what a key is placed by: a manifest goes with its name)
        keys = list(dict.fromkeys(placed_by(k) for k in chosen))
        if not keys:
            return 0
        held = {placed_by(k) for k in sizes}
        for key in [k for k in cluster.claims if k not in held]:
            del cluster.claims[key]  # (held nowhere any more: it places nothing)
        if len(cluster.claims) + len(keys) > MAX_CLAIMS:
            log.info("no more claims: this node claims %d keys already", len(cluster.claims))
            return 0
        if await cluster.transitions.claim(keys):
            self.claimed += len(keys)
            return len(keys)
        return 0
