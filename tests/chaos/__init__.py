"""Randomized cluster runs: a seeded generator, a nemesis and a checker (as Jepsen's).

Theory of operation. One seed makes one run, and the run is only as random as the seed:
:mod:`.plan` draws from ``random.Random(seed)`` the cluster (N nodes, R, ``--acks``, a
coordinator or not), the keys, the clients (routed or pinned to a node) with their lanes of
operations (whole writes, gradient pushes under every rule, row pushes and pulls, reads with
``min_version``, barriers), and the faults. :mod:`.cluster` runs real node processes (and a
real etcd) on loopback; :mod:`.workload` runs the clients and records every op in a
:mod:`.history` (invoked, completed, ok / failed / indeterminate / hung); :mod:`.nemesis`
makes the faults at their times (kill -9 and restart, a join, a drain, a cut or delayed peer
link, etcd killed) and heals them; :mod:`.run` lets the cluster settle and reads every replica;
:mod:`.checker` says what the history and that state violate. ``tests/test_randomized_cluster.py``
runs a fixed set of seeds (and any seed given: a failure prints the command that runs it again).
"""
