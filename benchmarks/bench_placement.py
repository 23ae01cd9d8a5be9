#!/usr/bin/env python3
"""Placement's balance and moves: keys and bytes per node, and what one join or leave moves.

No network, no node: the project's own sharding function (``aioparamsync.placement``, rendezvous
hashing) applied to a simulated model's keys::

    python benchmarks/bench_placement.py [--keys 100000] [--quick] [--nodes 3,5,10,30,100]
                                         [--rs 1,2,3] [--seed 0]

The keys are those of a made-up model: tensors whose sizes are drawn from a seeded lognormal
(median 64 KiB, sigma 2.5: many small biases and norms of a few KiB, weight matrices of MBs,
a few embeddings of hundreds of MB; clipped to [256 B, 1 GiB], a multiple of 4 bytes). A tensor
of more than ``--partition-bytes`` (4 MB) is cut into ``ceil(size / partition_bytes)``
partitions, each one key, ``partition_key(name, i)``, as the system does; the smaller ones are
one key each, their name. Tensors are drawn until there are ``--keys`` keys (the last tensor's
partitions cut off there).

For each number of nodes N (ids ``host:port``, as nodes have by default), each key is placed
with ``Placement(members, max(rs)).replicas(key)``: the real function, whose first R replicas
are the key's replicas with R (``replicas`` is the first R of one ranking; the script checks it
against ``Placement(members, R)`` on a sample of keys). The same is done for N+1 members (one
joins) and N-1 (one leaves). Then, per (N, R):

* keys and bytes per node (each replica counts the key's whole size): the mean, and the max and
  min as a multiple of the mean. A node holds each key with probability R/N, so ``1sd/mean`` is
  one standard deviation of its keys (its bytes) over their mean, to read max/mean and min/mean
  by;
* the fraction of keys whose replica set changed on the join, beside ``R/(N+1)`` (what
  rendezvous hashing predicts), and of bytes; the same on the leave, beside ``R/N`` (the share
  the leaving node held); ``stray``: keys that moved in any other way (between old members on
  a join, or not held by the one leaving), which must be 0.

Pure Python hashing, N blake2b per key and member list, and the balancing rounds by ``plan``
itself: the default (10^5 keys, five values of N, each with a join and a leave) takes about two
minutes on one core; ``--quick`` (10^4 keys) a few seconds.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aioparamsync.cluster.balance import GAIN as BALANCE_GAIN
from aioparamsync.cluster.balance import SLACK as BALANCE_SLACK
from aioparamsync.cluster.balance import plan
from aioparamsync.placement import Placement, partition_key, replicas

PARTITION_BYTES = 4_000_000
SIZE_MEDIAN_BYTES = 64 * 1024
SIZE_SIGMA = 2.5
SIZE_MIN_BYTES, SIZE_MAX_BYTES = 256, 1 << 30
SAMPLE_CHECKED = 200  # keys per member list whose slices are checked against Placement(m, R)


LEGEND = """\
keys/node, MB/node: the mean over the N nodes (each replica counts its key's bytes);
  max/mean, min/mean: the fullest and the emptiest node.
1sd/mean: one standard deviation of one node's keys (bytes), a node holding each key with
  probability R/N, over the mean; 0 when R >= N (every node holds every key).
join: the fraction of keys whose replica set changed when an (N+1)th node joined, beside
  R/(N+1), what rendezvous hashing predicts; bytes: their share of the bytes.
leave: the same when one of the N nodes left, beside R/N, the share it held.
stray: keys that moved in any other way (between old nodes on the join, or not held by the
  one that left): 0 for rendezvous hashing."""


def member_ids(n: int) -> list[str]:
    return [f"10.0.{i // 250}.{i % 250 + 1}:7000" for i in range(n)]


def model_keys(k: int, seed: int, partition_bytes: int) -> tuple[list[str], np.ndarray, int]:
    """``k`` keys of a simulated model, their sizes in bytes, and how many tensors they cover."""
    rng = np.random.default_rng(seed)
    # At most k tensors are needed: each is at least one key.
    sizes = rng.lognormal(math.log(SIZE_MEDIAN_BYTES), SIZE_SIGMA, size=k)
    sizes = np.clip(np.round(sizes / 4) * 4, SIZE_MIN_BYTES, SIZE_MAX_BYTES).astype(np.int64)
    keys: list[str] = []
    key_bytes: list[int] = []
    tensors = 0
    for i, size in enumerate(sizes.tolist()):
        if len(keys) >= k:
            break
        tensors += 1
        name = f"model.{i}.weight"
        if size <= partition_bytes:
            keys.append(name)
            key_bytes.append(size)
            continue
        parts = math.ceil(size / partition_bytes)
        for j in range(parts):
            keys.append(partition_key(name, j))
            key_bytes.append(min(partition_bytes, size - j * partition_bytes))
    return keys[:k], np.array(key_bytes[:k], dtype=np.int64), tensors


def place(keys: list[str], members: list[str], rmax: int, index: dict[str, int]) -> np.ndarray:
    """Each key's first ``min(rmax, N)`` replicas, as indices in ``index``: shape (K, R)."""
    placement = Placement(members, rmax)
    width = min(rmax, len(members))
    out = np.empty((len(keys), width), dtype=np.int32)
    for row, key in enumerate(keys):
        out[row] = [index[m] for m in placement.replicas(key)]
    return out


def check_slices(
    keys: list[str], members: list[str], rs: list[int], placed: np.ndarray, ids: list[str]
) -> None:
    """The first R of the R=max ranking are the R replicas: checked on a sample of keys.

    ``ids``: the member of each index in ``placed``.
    """
    for r in rs:
        exact = Placement(members, r)
        for row in range(0, len(keys), max(1, len(keys) // SAMPLE_CHECKED)):
            got = [ids[i] for i in placed[row, : min(r, len(members))]]
            want = list(exact.replicas(keys[row]))
            assert got == want == replicas(keys[row], members, r), (keys[row], r, got, want)


def changed_rows(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Which keys' replica sets differ (as sets: order does not count)."""
    if old.shape[1] != new.shape[1]:
        return np.ones(len(old), dtype=bool)
    return (np.sort(old, axis=1) != np.sort(new, axis=1)).any(axis=1)


def within(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row, whether each entry of ``a`` is somewhere in the same row of ``b``: (K, Ra)."""
    return (a[:, :, None] == b[:, None, :]).any(axis=2)


def balance_rounds(sizes: np.ndarray, primary: np.ndarray, n: int) -> int:
    """Rounds of every member (in index order), each claiming what ``plan``
    (``aioparamsync.cluster.balance``) picks, until none claims: ``primary`` (each key's
    primary, an index < ``n``) is changed in place; answers how many keys were claimed."""
    members = [str(i) for i in range(n)]
    names = [str(k) for k in range(len(sizes))]  # (plan's ties: by name, as nodes break them)
    by_name = dict(zip(names, sizes.astype(np.int64).tolist(), strict=True))
    claimed = 0
    while True:
        progress = False
        for me in members:
            primary_of = dict(zip(names, map(str, primary.tolist()), strict=True))
            chosen = plan(me, by_name, primary_of, members)
            if chosen:
                primary[[int(k) for k in chosen]] = int(me)
                claimed += len(chosen)
                progress = True
        if not progress:
            return claimed


def summarize(counts: np.ndarray) -> tuple[float, float, float]:
    mean = float(counts.mean())
    return mean, float(counts.max()) / mean, float(counts.min()) / mean


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=None, help="keys (default 100000)")
    parser.add_argument("--quick", action="store_true", help="10^4 keys (unless --keys)")
    parser.add_argument("--nodes", default="3,5,10,30,100", help="numbers of nodes")
    parser.add_argument("--rs", default="1,2,3", help="replication factors")
    parser.add_argument("--partition-bytes", type=int, default=PARTITION_BYTES)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    k = args.keys if args.keys is not None else 10_000 if args.quick else 100_000
    nodes = [int(x) for x in args.nodes.split(",")]
    rs = sorted({int(x) for x in args.rs.split(",")})
    if k < 1 or min(nodes) < 2 or min(rs) < 1 or args.partition_bytes < 1:
        parser.error("--keys, --rs and --partition-bytes must be at least 1, --nodes at least 2")
    rmax = max(rs)

    print("$ python " + shlex.join([sys.argv[0], *(sys.argv[1:] if argv is None else argv)]))
    start = time.perf_counter()
    keys, key_bytes, tensors = model_keys(k, args.seed, args.partition_bytes)
    partitioned = sum(1 for key in keys if "\x00" in key)
    print(
        f"{len(keys)} keys: {tensors} tensors, {partitioned} keys are partitions of "
        f"{args.partition_bytes / 1e6:g} MB; {key_bytes.sum() / 1e9:.1f} GB in all, "
        f"key sizes p50 {np.median(key_bytes) / 1e3:.0f} kB, mean {key_bytes.mean() / 1e3:.0f} "
        f"kB (lognormal tensors: median {SIZE_MEDIAN_BYTES // 1024} KiB, sigma {SIZE_SIGMA}, "
        f"seed {args.seed})"
    )
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}")
    print(flush=True)

    rows = []
    balanced_rows = []
    for n in nodes:
        t0 = time.perf_counter()
        members = member_ids(n + 1)  # the last one is the one that joins
        index = {m: i for i, m in enumerate(members)}
        base_members, joined = members[:n], n
        left = n // 2  # any old member: the one in the middle of the list
        leave_members = [m for i, m in enumerate(base_members) if i != left]
        base = place(keys, base_members, rmax, index)
        join = place(keys, members, rmax, index)
        leave = place(keys, leave_members, rmax, index)
        for member_list, placed in (
            (base_members, base),
            (members, join),
            (leave_members, leave),
        ):
            check_slices(keys, member_list, rs, placed, members)
        total_bytes = float(key_bytes.sum())
        squares = float((key_bytes.astype(np.float64) ** 2).sum())
        for r in rs:
            b, j, lv = base[:, : min(r, n)], join[:, : min(r, n + 1)], leave[:, : min(r, n - 1)]
            flat = b.ravel()
            counts = np.bincount(flat, minlength=n)[:n]
            node_bytes = np.bincount(flat, weights=np.repeat(key_bytes, b.shape[1]), minlength=n)
            p = min(r, n) / n
            # A node holds each key with probability p, independently of the key's size:
            # its count has sd sqrt(K p (1 - p)), its bytes sqrt(p (1 - p) sum(size^2)).
            sd_rel = math.sqrt(k * p * (1 - p)) / (k * p)
            bytes_sd_rel = math.sqrt(p * (1 - p) * squares) / (p * total_bytes)
            join_changed = changed_rows(b, j)
            # On a join, every replica after it is an old one of the key, or the new member.
            join_stray = ~(within(j, b) | (j == joined)).all(axis=1)
            leave_changed = changed_rows(b, lv)
            held = (b == left).any(axis=1)
            # On a leave, every old replica but the one leaving stays, and a key it did not
            # hold keeps its replica set.
            leave_stray = ~(within(b, lv) | (b == left)).all(axis=1) | (leave_changed & ~held)
            if r == 1:
                sizes = key_bytes.astype(np.float64)
                # Balanced by bytes (claims): rounds until stable, then a join and
                # rounds again; what moved is measured against the joiner's share.
                before = b[:, 0].copy()
                claims = balance_rounds(sizes, before, n)
                balanced = np.bincount(before, weights=sizes, minlength=n)[:n]
                claimed = before != b[:, 0]
                after = np.where(claimed, before, j[:, 0])  # (claims keep their claimer)
                balance_rounds(sizes, after, n + 1)
                moved = after != before
                stray_moves = moved & (after != joined)
                rebalanced = np.bincount(after, weights=sizes, minlength=n + 1)
                balanced_rows.append(
                    (
                        n,
                        float(node_bytes[:n].max() / node_bytes[:n].mean()),
                        float(balanced.max() / balanced.mean()),
                        claims,
                        float(rebalanced.max() / rebalanced.mean()),
                        float(sizes[moved].sum() / (total_bytes / (n + 1))),
                        float(sizes[stray_moves].sum() / (total_bytes / (n + 1))),
                    )
                )
            rows.append(
                (
                    n,
                    r,
                    *summarize(counts),
                    sd_rel,
                    *summarize(node_bytes[:n]),
                    bytes_sd_rel,
                    join_changed.mean(),
                    min(r, n + 1) / (n + 1),
                    key_bytes[join_changed].sum() / total_bytes,
                    leave_changed.mean(),
                    min(r, n) / n,
                    key_bytes[leave_changed].sum() / total_bytes,
                    int(join_stray.sum() + leave_stray.sum()),
                )
            )
        print(
            f"  N={n}: {time.perf_counter() - t0:.1f} s ({3 * n} hashes per key)",
            file=sys.stderr,
            flush=True,
        )

    header = (
        "    N  R | keys/node  max/mean  min/mean  1sd/mean |"
        "  MB/node  max/mean  min/mean  1sd/mean |"
        "  join  R/(N+1)  bytes | leave    R/N  bytes | stray"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        n, r, kmean, kmax, kmin, ksd, bmean, bmax, bmin, bsd, jf, jexp, jb, lf, lexp, lb, stray = (
            row
        )
        print(
            f"{n:5d} {r:2d} | {kmean:9.0f}  {kmax:8.3f}  {kmin:8.3f}  {ksd:8.3f} |"
            f" {bmean / 1e6:8.0f}  {bmax:8.3f}  {bmin:8.3f}  {bsd:8.3f} |"
            f" {jf:5.3f}  {jexp:7.3f}  {jb:5.3f} | {lf:5.3f}  {lexp:5.3f}  {lb:5.3f} | {stray:5d}"
        )
    print()
    print(LEGEND)
    if balanced_rows:
        print()
        print(
            f"Balanced by bytes (claims, R=1 primaries; slack {BALANCE_SLACK:g}, gain "
            f"{BALANCE_GAIN:g}): rounds until "
            "none claims, then a join, and rounds again"
        )
        head = "    N | hashed max/mean | balanced max/mean  claims | after a join: max/mean"
        head += "  moved/share  of it not to the joiner"
        print(head)
        print("-" * len(head))
        for n, hashed, bal, claims, rebal, moved_share, stray_share in balanced_rows:
            print(
                f"{n:5d} | {hashed:15.3f} | {bal:17.3f}  {claims:6d} | {rebal:22.3f}"
                f"  {moved_share:11.2f}  {stray_share:22.2f}"
            )
    print(f"\n{time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
