"""Placement: which nodes hold a key, in what order; the one sharding function.

A key is a parameter's name, a barrier group (:func:`barrier_key`), or one
partition of a large parameter (:func:`partition_key`; the parameter's
manifest, :func:`manifest_key`, is placed by its name). The nodes
that hold it are its **replicas**: the members ranked by rendezvous
(highest-random-weight) hashing, ``hash(member, key)`` highest first, the
first ``R`` of them (every member when there are fewer). The first of them
that is live is the key's **primary**: writes go there, it folds the key's
gradients and holds its barriers, and it replicates to the others.

Why rendezvous: each key ranks every member independently, so a member that
joins takes about ``R/N`` of the keys (those where it ranks in the top ``R``)
and moves nothing else; a member that leaves hands on only the keys it held,
each to the next member of that key's own ranking. No ring, no virtual nodes:
with K keys over N members, a member's share is binomial, about ``K*R/N``
give or take ``sqrt(K*R/N)`` (``benchmarks/bench_placement.py`` measures the
balance and the moves).

Balanced by bytes: **claims**. Hashing spreads keys, not bytes: a model has
few, unequal tensors (32 keys over 4 members landed 13/9/6/4), and the
busiest member sets every step's pace. So a member may *claim* a key: it is
then the key's first replica (its primary), the others the first ``R - 1`` of
the key's ranking without it. A claim is the claimer's own, told with its
state (the IDL's ``Member.claims``: key -> the epoch it claimed it at); of two
claims of one key the later wins, then the smaller member id
(:func:`claims_of`). Claims of members not placed count for nothing. Since a
claim makes only the claimer a new replica of its key (the others were
replicas already), a member takes a key over as a joining one does: it pulls
it first, then says so (see :mod:`aioparamsync.cluster.balance`). The claims
of the members placed are part of the topology: clients route by them too.

Pure functions of the member ids (and claims) given (no I/O, no asyncio): the
nodes of a cluster, and the clients that route to them, compute the same
placement from the same topology. :class:`Placement` caches the replicas of
each key for one set of members and claims (a topology's epoch).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Container, Iterable, Mapping, Sequence

import numpy as np

__all__ = [
    "DEFAULT_REPLICATION_FACTOR",
    "Placement",
    "barrier_key",
    "bucket_key",
    "bucket_of",
    "claims_of",
    "mix64",
    "is_reserved",
    "manifest_key",
    "parse_key",
    "partition_key",
    "placed_by",
    "primary",
    "rank",
    "replicas",
]

# How many nodes hold each key by default (fewer when the cluster has fewer).
DEFAULT_REPLICATION_FACTOR = 3

# A member's states (the IDL's TopologyMember.state). What it says of itself:
JOINING, UP, LEAVING, LEFT = "joining", "up", "leaving", "left"
# ... and, of a member that says it is up, what another sees when it does not answer:
DOWN, FAILED = "down", "failed"  # (failed: down longer than the failure timeout)
#: the states of the members placement ranks (those that hold keys): a member
#: leaving holds its keys until it has handed them off
PLACED = frozenset({UP, DOWN, LEAVING})
#: the states of the members that answer (a key's primary is its first replica in one)
LIVE = frozenset({UP, LEAVING})
#: the states a member may say of itself
SELF_STATES = frozenset({JOINING, UP, LEAVING, LEFT})
# A partition's key: the parameter's name, this separator, its index; its
# manifest's: the name, the separator, MANIFEST. (A name a client gives may not
# hold NUL, so no name equals such a key, or a barrier's: the nodes refuse them.)
PARTITION_SEPARATOR = "\x00#"
MANIFEST = "m"
_MANIFEST_SUFFIX = PARTITION_SEPARATOR + MANIFEST
# The most keys a Placement remembers the ranking of (then it starts over).
CACHE_KEYS = 1 << 20


def partition_key(name: str, index: int) -> str:
    """The key partition ``index`` of parameter ``name`` is placed (and stored) by."""
    return f"{name}{PARTITION_SEPARATOR}{index}"


def manifest_key(name: str) -> str:
    """The key the manifest of partitioned parameter ``name`` is stored by (placed by ``name``)."""
    return name + _MANIFEST_SUFFIX


def is_reserved(key: str) -> bool:
    """Whether ``key`` is no name a client gives: it holds NUL (a partition, a manifest...)."""
    return "\x00" in key


def parse_key(key: str) -> tuple[str, int | None] | None:
    """``(name, index)`` of a partition's key, ``(name, None)`` of a manifest's; else None.

    Only keys :func:`partition_key` and :func:`manifest_key` make, of names
    without NUL, parse (an index in its decimal form: no sign, no leading zero).
    """
    name, sep, rest = key.rpartition(PARTITION_SEPARATOR)
    if not sep or not name or "\x00" in name:
        return None
    if rest == MANIFEST:
        return name, None
    if rest.isascii() and rest.isdigit() and (rest == "0" or rest[0] != "0"):
        return name, int(rest)
    return None


def placed_by(key: str) -> str:
    """What ``key`` is placed by: a manifest by its parameter's name, any other key by itself.

    So a read of a name finds it, or its manifest, at the same nodes.
    """
    return key[: -len(_MANIFEST_SUFFIX)] if key.endswith(_MANIFEST_SUFFIX) else key


def barrier_key(group: str) -> str:
    """The key a barrier group is placed by: its primary holds the barrier."""
    return f"\x00barrier\x00{group}"


def bucket_key(table: str, bucket: int) -> str:
    """The key bucket ``bucket`` of embedding table ``table`` is placed by: its replicas
    hold the bucket's rows, its primary folds their gradients."""
    return f"\x00rows\x00{table}\x00{bucket}"


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of every value of ``x`` (uint64): a fixed, well-mixed hash."""
    # (an array's integer multiplication wraps modulo 2**64 without a warning)
    x = x.astype(np.uint64, copy=True)
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def bucket_of(ids: np.ndarray, buckets: int) -> np.ndarray:
    """The bucket of each row id (int64) of a table of ``buckets`` buckets, as int64.

    A hash, not ``id % buckets``: ids that are multiples of a stride (hashed
    features often are) spread over every bucket. Its high 32 bits: a bucket's
    index (:class:`~aioparamsync.values.rowindex.RowIndex`) places its ids by the
    low bits of the same hash, which must not be alike for the ids of one bucket.
    """
    high = mix64(ids.view(np.uint64)) >> np.uint64(32)
    return (high % np.uint64(buckets)).astype(np.int64)


def _score(member: str, key: str) -> bytes:
    return hashlib.blake2b(f"{member}\0{key}".encode(), digest_size=8).digest()


def rank(key: str, members: Iterable[str]) -> list[str]:
    """Every member, by rendezvous score for ``key``, highest first."""
    return sorted(members, key=lambda m: _score(m, key), reverse=True)


def replicas(key: str, members: Collection[str], r: int | None) -> list[str]:
    """The members that hold ``key``: the first ``r`` of :func:`rank` (all when ``r`` is None)."""
    ranked = rank(placed_by(key), members)
    return ranked if r is None else ranked[:r]


def primary(key: str, members: Collection[str], r: int | None, live: Container[str]) -> str | None:
    """The first live replica of ``key``; None when none is live."""
    return next((m for m in replicas(key, members, r) if m in live), None)


def claims_of(claims: Mapping[str, Mapping[str, int]]) -> dict[str, str]:
    """Each key claimed, and the member whose claim wins: ``claims`` are each member's
    (key -> the epoch it claimed the key at); the latest claim wins, then the
    smaller member id (see the module)."""
    won: dict[str, tuple[int, str]] = {}
    for member, keys in claims.items():
        for key, epoch in keys.items():
            best = won.get(key)
            if best is None or (epoch, best[1]) > (best[0], member):
                won[key] = (epoch, member)
    return {key: member for key, (_, member) in won.items()}


class Placement:
    """The replicas of every key for one set of members and one replication factor.

    Args:
        members: the ids of the members that hold keys (not those joining,
            leaving or failed).
        r: the replication factor; None or more than the members: every member.
        claims: key -> the member that claimed it (see :func:`claims_of`); claims
            of members not among ``members`` count for nothing.
    """

    __slots__ = ("_cache", "claims", "everywhere", "members", "r")

    def __init__(
        self, members: Iterable[str], r: int | None, claims: Mapping[str, str] | None = None
    ) -> None:
        self.members: tuple[str, ...] = tuple(sorted(set(members)))
        r = None if r is None else max(1, r)
        self.r = None if r is None or r >= len(self.members) else r
        #: every member holds every key (R >= N): no key needs routing (but claims
        #: still name its primary)
        self.everywhere = self.r is None
        placed = set(self.members)
        #: key -> the member that claimed it, of the members placed
        self.claims: dict[str, str] = {k: m for k, m in (claims or {}).items() if m in placed}
        self._cache: dict[str, tuple[str, ...]] = {}

    def __repr__(self) -> str:
        r = "all" if self.r is None else self.r
        claimed = f", {len(self.claims)} keys claimed" if self.claims else ""
        return f"<Placement R={r} over {len(self.members)} members{claimed}>"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        return (self.members, self.r, self.claims) == (other.members, other.r, other.claims)

    def __hash__(self) -> int:
        return hash((self.members, self.r, len(self.claims)))

    def replicas(self, key: str) -> tuple[str, ...]:
        """The members holding ``key``, in order (cached)."""
        cached = self._cache.get(key)
        if cached is None:
            if len(self._cache) >= CACHE_KEYS:
                self._cache.clear()
            claimer = self.claims.get(placed_by(key)) if self.claims else None
            if claimer is None:
                found = replicas(key, self.members, self.r)
            else:
                others = [m for m in rank(placed_by(key), self.members) if m != claimer]
                found = [claimer, *others]
                if self.r is not None:
                    found = found[: self.r]
            cached = self._cache[key] = tuple(found)
        return cached

    def holds(self, member: str, key: str) -> bool:
        """Whether ``member`` is one of the replicas of ``key``."""
        return (self.everywhere and member in self.members) or member in self.replicas(key)

    def primary(self, key: str, live: Container[str]) -> str | None:
        """The first live replica of ``key`` (None: none is live)."""
        for member in self.replicas(key):
            if member in live:
                return member
        return None

    def by_primary(self, keys: Sequence[str], live: Container[str]) -> dict[str | None, list[str]]:
        """``keys`` grouped by their primary (None: no replica of it is live)."""
        groups: dict[str | None, list[str]] = {}
        for key in keys:
            groups.setdefault(self.primary(key, live), []).append(key)
        return groups
