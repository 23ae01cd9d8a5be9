"""Placement (rendezvous hashing): determinism, the replicas' shape, primaries, balance, moves.

Plain synchronous tests of pure functions. The statistical ones use fixed keys, so they are
deterministic; their bounds are still set several standard deviations wide (each says how
many), so that another hash or other key names would pass them too.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from aioparamsync import placement
from aioparamsync.placement import (
    PARTITION_SEPARATOR,
    Placement,
    barrier_key,
    partition_key,
    primary,
    rank,
    replicas,
)

# Node ids are "host:port" by default (aioparamsync.node.Node).
MEMBERS = [f"10.0.0.{i}:7000" for i in range(1, 6)]
KEYS = ["w", "layer.0.weight", partition_key("emb", 3), barrier_key("train"), "", "é", "名前"]


def members_of(n: int) -> list[str]:
    return [f"10.0.{i // 250}.{i % 250 + 1}:7000" for i in range(n)]


def keys_of(k: int) -> list[str]:
    return [f"model.{i}.weight" for i in range(k)]


# -- determinism ---------------------------------------------------------------------


def test_rank_is_pinned() -> None:
    # Nodes and clients of different processes and versions must agree on placement, and a
    # key's replicas keep its stored copies: a change to the hash (or to the key formats)
    # moves every key, so it is pinned here.
    ten = "10.0.0.{}:7000"
    order = {
        "w": [3, 2, 5, 1, 4],
        "layer.0.weight": [2, 1, 5, 3, 4],
        partition_key("emb", 3): [3, 4, 1, 2, 5],
        barrier_key("train"): [4, 2, 5, 1, 3],
    }
    for key, expected in order.items():
        assert rank(key, MEMBERS) == [ten.format(i) for i in expected], key
    assert partition_key("emb", 3) == "emb\x00#3"
    assert barrier_key("train") == "\x00barrier\x00train"


def test_same_answer_every_time_and_whatever_the_order_of_members() -> None:
    rng = random.Random(1)
    for key in KEYS:
        expected = rank(key, MEMBERS)
        for _ in range(10):
            shuffled = MEMBERS[:]
            rng.shuffle(shuffled)
            assert rank(key, shuffled) == expected
            assert rank(key, tuple(shuffled)) == expected
            assert rank(key, iter(shuffled)) == expected
            for r in (None, 1, 2, 3, 5, 9):
                assert replicas(key, shuffled, r) == replicas(key, MEMBERS, r)
                assert Placement(shuffled, r).replicas(key) == tuple(replicas(key, MEMBERS, r))
        assert replicas(key, set(MEMBERS), 3) == expected[:3]


def test_placements_of_the_same_members_are_equal() -> None:
    a = Placement(MEMBERS, 3)
    b = Placement(reversed(MEMBERS + MEMBERS), 3)  # order and duplicates do not matter
    assert a == b and hash(a) == hash(b)
    assert a.members == tuple(sorted(MEMBERS))
    assert all(a.replicas(k) == b.replicas(k) for k in KEYS)
    assert a != Placement(MEMBERS, 2)
    assert a != Placement(MEMBERS[:-1], 3)
    assert a != "not a placement"
    assert repr(a) == "<Placement R=3 over 5 members>"
    assert repr(Placement(MEMBERS, None)) == "<Placement R=all over 5 members>"


# -- the replicas' shape -------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("r", [1, 2, 3, 5])
def test_replicas_are_distinct_members_min_r_n_of_them(n: int, r: int) -> None:
    members = members_of(n)
    for key in keys_of(50):
        got = replicas(key, members, r)
        assert len(got) == min(r, n)
        assert len(set(got)) == len(got)
        assert set(got) <= set(members)
        assert got == rank(key, members)[: len(got)]  # the top of the key's ranking


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_r_none_or_at_least_n_is_every_member(n: int) -> None:
    members = members_of(n)
    for r in (None, n, n + 1, 100):
        placed = Placement(members, r)
        assert placed.r is None and placed.everywhere
        for key in keys_of(20):
            assert replicas(key, members, r) == rank(key, members)
            assert sorted(placed.replicas(key)) == sorted(members)
            assert all(placed.holds(m, key) for m in members)
            assert not placed.holds("10.9.9.9:7000", key)


def test_rank_has_every_member_once() -> None:
    members = members_of(7)
    for key in keys_of(20):
        assert sorted(rank(key, members)) == sorted(members)


# -- primaries -----------------------------------------------------------------------


def test_primary_is_the_first_live_replica() -> None:
    for key in KEYS:
        top = replicas(key, MEMBERS, 3)
        assert primary(key, MEMBERS, 3, set(MEMBERS)) == top[0]
        assert primary(key, MEMBERS, 3, {top[1], top[2]}) == top[1]
        assert primary(key, MEMBERS, 3, {top[2]}) == top[2]
        # A live member that is not a replica is never the primary: none live, None.
        others = set(MEMBERS) - set(top)
        assert primary(key, MEMBERS, 3, others) is None
        assert primary(key, MEMBERS, 3, set()) is None
        assert primary(key, MEMBERS, 3, ()) is None
        # live is any container: a list works as a set does.
        assert primary(key, MEMBERS, 3, [top[2], top[1]]) == top[1]
        # R = None: every member is a replica, so any live one can be the primary.
        assert primary(key, MEMBERS, None, others) == next(
            m for m in rank(key, MEMBERS) if m in others
        )
    assert primary("w", [], 3, set(MEMBERS)) is None


@pytest.mark.parametrize("r", [None, 1, 2, 3, 5])
def test_placement_agrees_with_the_free_functions(r: int | None) -> None:
    placed = Placement(MEMBERS, r)
    keys = keys_of(200)
    rng = random.Random(2)
    lives = [set(), set(MEMBERS), {MEMBERS[0]}, set(MEMBERS[1:3])]
    lives += [set(rng.sample(MEMBERS, 2)) for _ in range(4)]
    for key in keys:
        expected = replicas(key, MEMBERS, r)
        assert placed.replicas(key) == tuple(expected)
        assert placed.replicas(key) is placed.replicas(key)  # cached
        for m in [*MEMBERS, "10.9.9.9:7000"]:
            assert placed.holds(m, key) == (m in expected)
        for live in lives:
            assert placed.primary(key, live) == primary(key, MEMBERS, r, live)
    for live in lives:
        groups = placed.by_primary(keys, live)
        # Every key once, under its primary, in the order given.
        assert sorted(k for ks in groups.values() for k in ks) == sorted(keys)
        for owner, ks in groups.items():
            assert ks, "no empty group"
            assert all(primary(k, MEMBERS, r, live) == owner for k in ks)
            members_of_group = set(ks)
            assert ks == [k for k in keys if k in members_of_group]
        if not live:
            assert list(groups) == [None]
    assert placed.by_primary([], set(MEMBERS)) == {}


def test_the_cache_starts_over_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement, "CACHE_KEYS", 4)
    placed = Placement(MEMBERS, 2)
    keys = keys_of(30)
    for _ in range(2):
        for key in keys:
            assert placed.replicas(key) == tuple(replicas(key, MEMBERS, 2))
            assert len(placed._cache) <= 4


# -- balance -------------------------------------------------------------------------


def test_balance_of_ten_thousand_keys_over_ten_nodes_r3() -> None:
    k, n, r = 10_000, 10, 3
    members = members_of(n)
    placed = Placement(members, r)
    counts = dict.fromkeys(members, 0)
    for key in keys_of(k):
        for m in placed.replicas(key):
            counts[m] += 1
    mean = k * r / n  # 3000
    assert sum(counts.values()) == k * r
    # A node's count is binomial(K, p = R/N): sd = sqrt(K p (1 - p)) = sqrt(2100) = 45.8
    # (the docstring's sqrt(K R/N) = 54.8 bounds it). 10% of the mean is 300 = 6.5 sd (5.5
    # by the bound): P(any of 10 nodes off by 5.5 sd) < 10 * 2 * 1.9e-8 = 4e-7.
    sd = math.sqrt(k * (r / n) * (1 - r / n))
    assert 0.10 * mean > 6 * sd
    for m, c in counts.items():
        assert abs(c - mean) <= 0.10 * mean, (m, c, mean)


# -- moves ---------------------------------------------------------------------------


def test_a_join_moves_keys_only_to_the_new_member() -> None:
    k, n, r = 10_000, 10, 2
    old_members = members_of(n)
    joined = "10.0.9.9:7000"
    old, new = Placement(old_members, r), Placement([*old_members, joined], r)
    changed = 0
    for key in keys_of(k):
        before, after = old.replicas(key), new.replicas(key)
        if after == before:
            continue
        changed += 1
        # The new member takes a place; the old replicas keep their order and shift down
        # behind it, and the last one drops off. Nothing moves between old members.
        assert joined in after, (key, before, after)
        assert tuple(m for m in after if m != joined) == before[: r - 1], (key, before, after)
    # Each key ranks the new member in its top R with probability R/N_new = 2/11: the count
    # is binomial, sd = sqrt(K p (1 - p)) = 38.6 keys; allow 5 sd (P(fail) ~ 6e-7).
    p = r / (n + 1)
    sd = math.sqrt(k * p * (1 - p))
    assert abs(changed - k * p) <= 5 * sd, (changed, k * p, sd)


def test_a_leave_moves_only_the_keys_the_member_held() -> None:
    k, n, r = 10_000, 10, 2
    old_members = members_of(n)
    left = old_members[3]
    old, new = Placement(old_members, r), Placement(set(old_members) - {left}, r)
    changed = 0
    for key in keys_of(k):
        before, after = old.replicas(key), new.replicas(key)
        if left not in before:
            assert after == before, (key, before, after)
            continue
        changed += 1
        # The other old replicas stay, in order; the next member of the key's own ranking
        # takes the last place.
        kept = tuple(m for m in before if m != left)
        assert after[: r - 1] == kept, (key, before, after)
        assert after[r - 1] == rank(key, old_members)[r], (key, before, after)
    # The member held each key with probability R/N = 0.2: sd = sqrt(K p (1 - p)) = 40 keys.
    p = r / n
    sd = math.sqrt(k * p * (1 - p))
    assert abs(changed - k * p) <= 5 * sd, (changed, k * p, sd)


def test_a_leave_when_r_is_at_least_n_gives_every_member_every_key() -> None:
    members = members_of(3)
    old, new = Placement(members, 3), Placement(members[1:], 3)
    assert old.everywhere and new.everywhere
    for key in keys_of(50):
        assert new.replicas(key) == tuple(m for m in old.replicas(key) if m != members[0])


# -- bad input -----------------------------------------------------------------------


def test_no_members() -> None:
    for r in (None, 0, 1, 3):
        assert replicas("w", [], r) == []
        assert rank("w", []) == []
        assert primary("w", [], r, {"a"}) is None
        placed = Placement([], r)
        assert placed.members == () and placed.everywhere
        assert placed.replicas("w") == ()
        assert not placed.holds("a", "w")
        assert placed.primary("w", {"a"}) is None
        assert placed.by_primary(["w", "x"], {"a"}) == {None: ["w", "x"]}


@pytest.mark.parametrize("n", [0, 1, 2, 5])
@pytest.mark.parametrize("r", [0, -1, -7])
def test_placement_with_r_zero_or_less_places_as_r_one(n: int, r: int) -> None:
    # Placement clamps R up to 1 (the free function does not: replicas(key, m, 0) == []).
    members = members_of(n)
    low, one = Placement(members, r), Placement(members, 1)
    live = set(members[1:])
    for key in keys_of(50):
        assert low.replicas(key) == one.replicas(key) == tuple(replicas(key, members, 1))
        assert all(low.holds(m, key) == one.holds(m, key) for m in members)
        assert low.primary(key, live) == one.primary(key, live)
    if n >= 2:
        assert low == one and low.r == one.r == 1 and not low.everywhere


@pytest.mark.parametrize(("n", "r"), [(1, 0), (1, -1), (0, -1)])
def test_placement_with_r_zero_or_less_over_at_most_one_member_equals_r_one(n: int, r: int) -> None:
    members = members_of(n)
    assert Placement(members, r) == Placement(members, 1)


def test_a_duplicate_member_counts_once_in_a_placement() -> None:
    placed = Placement([*MEMBERS, MEMBERS[0], MEMBERS[0]], 2)
    for key in keys_of(50):
        assert len(set(placed.replicas(key))) == 2
        assert placed.replicas(key) == tuple(replicas(key, MEMBERS, 2))


# Names as the store takes them: not empty, and without NUL (a name holding the partition
# separator would be a partition's key, see the test after this one).
NAMES = [
    "w",
    "W",
    "w0",
    "w#0",
    "w 0",
    "#",
    "0",
    "barrier",
    "barrier train",
    "\x01barrier\x01train",
    "layer.0.weight",
    "layer.0.weight#1",
    "é",
    "名前",
    "x" * 300,
    " ",
]


def test_partition_and_barrier_keys_collide_with_no_name_and_no_other_key() -> None:
    indices = [0, 1, 2, 9, 10, 11, 99, 100, 4095, 10**9]
    partitions = [partition_key(name, i) for name, i in itertools.product(NAMES, indices)]
    barriers = [barrier_key(g) for g in NAMES]
    assert len(set(partitions)) == len(partitions)  # (name, index) -> key is one to one
    assert len(set(barriers)) == len(barriers)
    names = set(NAMES)
    assert names.isdisjoint(partitions) and names.isdisjoint(barriers)
    assert set(partitions).isdisjoint(barriers)
    # And the two recover what they were made of.
    for key, (name, i) in zip(partitions, itertools.product(NAMES, indices), strict=True):
        assert key.split(PARTITION_SEPARATOR) == [name, str(i)]
    for key, g in zip(barriers, NAMES, strict=True):
        assert key.startswith("\x00") and key.endswith(g)


def test_a_name_holding_the_separator_would_be_a_partition_key() -> None:
    # Why names must not hold the separator (or begin with NUL): these names would collide.
    names = {"w\x00#0", "\x00barrier\x00g"}
    assert partition_key("w", 0) in names and barrier_key("g") in names
    assert partition_key("\x00barrier\x00g", 0) == barrier_key("g\x00#0")
