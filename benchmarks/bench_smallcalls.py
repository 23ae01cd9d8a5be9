#!/usr/bin/env python3
"""Small calls, the node beside Apache Thrift's C++ server, both driven by a client in C++.

``bench_node.py`` drives every server from Python: at 4 KiB its client takes a core of its
own and the servers look alike. Here the client is ``benchmarks/cpp/loadgen.cpp`` (Thrift's
own C++ client, one thread and one connection per ``--conns``, built by ``cppserver.py``),
so what is measured is the server::

    python benchmarks/bench_smallcalls.py                      # 4KiB, 8 conns, 3 reps, 2 s
    python benchmarks/bench_smallcalls.py --sizes 256,4KiB,64KiB --conns 1,8 --reps 5
    python benchmarks/bench_smallcalls.py --node-args="--acks all"

For each repetition, size and connection count, each variant (``cpp``: the C++ server as
``bench_node.py`` runs it, a pool thread per connection; ``node``: ``aioparamsync-node``;
``node-pure``: the node without its compiled extensions) gets a fresh server process, in an
order that rotates every repetition; the load generator runs ``update_parameters`` for
``--seconds`` after ``--warmup``, then ``get_parameters``, each connection on a parameter of
its own. Printed: medians of calls/s, p50 and p99 latency and the server's CPU (cores), and
each node variant / ``cpp``. The client and the servers share the machine's CPUs (as on a
2-core host they must): a client that costs less leaves the server more.

Needs ``g++``, ``thrift-compiler``, ``libthrift-dev`` and ``libboost-dev``; it says which is
missing and exits 1. Uses 127.0.0.1 only; stops every process it started, by PID.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_node import (
    HOST,
    ServerFailed,
    ServerProcess,
    _list_of,
    cpp_environment,
    fmt_size,
    parse_size,
    run_environment,
)

THIS = Path(__file__).resolve()
VARIANTS = ("cpp", "node", "node-pure", "node-2proc")
OPS = ("update", "get")
LOADGEN_GRACE = 30.0  # seconds past its own run before a load generator counts as hung


def drive(loadgen: Path, address: tuple[str, int], op: str, size: int, conns: int,
          args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """One phase of the load generator against ``address``: its JSON line."""
    cmd = [
        str(loadgen), "--host", address[0], "--port", str(address[1]), "--op", op,
        "--size", str(size), "--conns", str(conns),
        "--seconds", str(args.seconds), "--warmup", str(args.warmup),
    ]  # fmt: skip
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=args.seconds + args.warmup + LOADGEN_GRACE,
        check=False,
    )
    if done.returncode != 0:
        raise ServerFailed(f"loadgen {op} failed ({done.returncode}): {done.stderr.strip()}")
    return json.loads(done.stdout)


def run_once(variant: str, size: int, conns: int, loadgen: Path, cpp_server: Path | None,
             env: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """A fresh server of ``variant``, both phases against it: {op: phase, ...}."""
    cmd = None
    if variant == "cpp":
        assert cpp_server is not None
        cmd = [str(cpp_server), "--host", HOST, "--port", "0", "--threads", str(conns)]
        env = cpp_environment(env, args.malloc)
    server = ServerProcess(variant, env, cmd=cmd, node_args=args.node_args)
    result: dict[str, Any] = {}
    try:
        for op in OPS:
            cpu0, t0 = server.cpu_seconds(), time.monotonic()
            phase = drive(loadgen, server.address, op, size, conns, args)
            phase["server_cores"] = (server.cpu_seconds() - cpu0) / (time.monotonic() - t0)
            result[op] = phase
    except BaseException:
        if server.proc.poll() is not None:
            print(f"{variant} server died: {server.stderr_tail()}", file=sys.stderr)
        raise
    finally:
        server.stop()
    return result


def summarize(runs: list[dict[str, Any]], variants: list[str]) -> str:
    """The medians per (size, conns, variant), and each variant over cpp."""
    rows = []
    medians: dict[tuple[int, int, str], dict[str, float]] = {}
    for size, conns in dict.fromkeys((r["size"], r["conns"]) for r in runs):
        for variant in sorted(variants, key=lambda v: v != "cpp"):  # (cpp first: the base)
            mine = [
                r for r in runs if (r["size"], r["conns"], r["variant"]) == (size, conns, variant)
            ]
            if not mine:
                continue
            med = {
                f"{op}_{k}": statistics.median(r[op][k] for r in mine)
                for op in OPS
                for k in ("calls_per_s", "p50_us", "p99_us", "server_cores")
            }
            medians[(size, conns, variant)] = med
            base = medians.get((size, conns, "cpp"))
            ratio = (
                f"{med['update_calls_per_s'] / base['update_calls_per_s']:.2f} / "
                f"{med['get_calls_per_s'] / base['get_calls_per_s']:.2f}"
                if base and variant != "cpp"
                else "-"
            )
            rows.append(
                f"| {fmt_size(size):>6} | {conns:>5} | {variant:>9} | {len(mine)} "
                f"| {med['update_calls_per_s']:>10.0f} | {med['update_p50_us']:>7.0f} "
                f"| {med['update_p99_us']:>7.0f} | {med['get_calls_per_s']:>10.0f} "
                f"| {med['get_p50_us']:>7.0f} | {med['get_p99_us']:>7.0f} "
                f"| {med['update_server_cores']:.2f} / {med['get_server_cores']:.2f} "
                f"| {ratio:>11} |"
            )
    head = (
        "|   size | conns |   variant | n | upd calls/s | upd p50 us | upd p99 us "
        "| get calls/s | get p50 us | get p99 us | server cores u/g | / cpp (u/g) |\n"
        "|--------|-------|-----------|---|-------------|------------|------------"
        "|-------------|------------|------------|------------------|-------------|"
    )
    return "\n".join([head, *rows])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variants", type=_list_of(str), default=list(VARIANTS[:2]),
                        help=f"of {','.join(VARIANTS)} (default: cpp,node)")  # fmt: skip
    parser.add_argument("--sizes", type=_list_of(parse_size), default=[4096],
                        help="payload sizes, e.g. 256,4KiB (default: 4KiB)")  # fmt: skip
    parser.add_argument("--conns", type=_list_of(int), default=[8],
                        help="connections (load generator threads) (default: 8)")  # fmt: skip
    parser.add_argument("--reps", type=int, default=3, help="(default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="counted seconds per phase (default: %(default)s)")  # fmt: skip
    parser.add_argument("--warmup", type=float, default=0.5,
                        help="not counted, before each phase (default: %(default)s)")  # fmt: skip
    parser.add_argument("--node-args", type=str, default="",
                        help="flags for the node, e.g. --node-args='--acks all'")  # fmt: skip
    parser.add_argument("--malloc", choices=("tuned", "default"), default="tuned",
                        help="as bench_node.py's (default: %(default)s)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write every run here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or not args.variants:
        print(f"unknown variants {bad}; choose from {','.join(VARIANTS)}", file=sys.stderr)
        return 2
    if args.reps < 1 or args.seconds <= 0 or args.warmup < 0:
        print("--reps must be >= 1, --seconds > 0, --warmup >= 0", file=sys.stderr)
        return 2
    if any(c < 1 for c in args.conns) or any(s < 0 for s in args.sizes):
        print("--conns must be >= 1 and --sizes >= 0", file=sys.stderr)
        return 2
    args.node_args = args.node_args.split()
    env = run_environment(args.malloc, THIS, reexec=argv is None)
    if env is None:
        return 2
    from cppserver import CppBaselineUnavailable, build

    try:
        loadgen = build(program="loadgen")
        cpp_server = build() if "cpp" in args.variants else None
    except CppBaselineUnavailable as exc:
        print(f"bench_smallcalls: {exc.reason}", file=sys.stderr)
        return 1
    runs: list[dict[str, Any]] = []
    total = args.reps * len(args.sizes) * len(args.conns) * len(args.variants)
    try:
        for rep in range(args.reps):
            turn = rep % len(args.variants)
            order = args.variants[turn:] + args.variants[:turn]
            for size in args.sizes:
                for conns in args.conns:
                    for variant in order:
                        result = run_once(variant, size, conns, loadgen, cpp_server, env, args)
                        runs.append({"variant": variant, "size": size, "conns": conns,
                                     "rep": rep, **result})  # fmt: skip
                        print(
                            f"[{len(runs)}/{total}] {variant:>9} {fmt_size(size)} x{conns} "
                            f"rep{rep}: update {result['update']['calls_per_s']:.0f}/s, "
                            f"get {result['get']['calls_per_s']:.0f}/s",
                            flush=True,
                        )
    except KeyboardInterrupt:
        print("interrupted; the servers started were stopped", file=sys.stderr)
        return 130
    except (ServerFailed, subprocess.TimeoutExpired) as exc:
        print(f"bench_smallcalls: {exc}", file=sys.stderr)
        return 1
    print()
    print(
        f"client: {loadgen.name} (C++); servers fresh per run; medians of {args.reps}; "
        f"{args.seconds} s per phase after {args.warmup} s; node args {args.node_args}"
    )
    print(summarize(runs, args.variants))
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
