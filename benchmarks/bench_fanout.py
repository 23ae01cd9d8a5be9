#!/usr/bin/env python3
"""How long K readers take to get a new model version: all from one node, or from a tree of
followers.

One command, as root (hosts are network namespaces: see ``netlab.py``)::

    python benchmarks/bench_fanout.py [--readers 8] [--followers 2] [--model-bytes 256MiB]
                                      [--mbit 300] [--rounds 2] [--json out.json]

Hosts, each with a link of ``--mbit`` Mbit/s each way (htb): a leader node; ``--followers``
nodes, each a follower of the leader (``--follow``); ``--readers`` reader hosts. A control
host (unshaped) writes. The model is float32 tensors of 4 MiB adding up to
``--model-bytes``, written at the leader; every reader reads it once (warm).

Then, each round, the control host writes a new version of every tensor (in calls of 64 MiB,
all at once), and every reader, which waits for that version in long polls (``get_arrays(names,
min_version=v, wait=...)``, 64 MiB of names each, all at once), reads the whole model.
Reported per arrangement: the time from the write's acknowledgement to the last reader holding
the new version (the median over rounds; every host's clock is the machine's), and the bytes
per second that makes over all readers.

Arrangements: ``one node``, every reader reads from the leader; ``tree``, reader i reads
from follower i mod F: the leader's link carries the model F times, each follower's K/F
times, at once. With K readers on links of rate B, one node needs about K * model / B; the
tree about max(F, K/F) * model / B.

Caveat: on a 2-core machine every host shares the same CPUs; ``busy`` is the machine's
busy CPUs over the rounds (2.0: saturated: the row measures the CPUs, not the links).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_cluster import _positive_float, machine_cpu_seconds
from bench_node import (
    REPO,
    _die_with_parent,
    _positive_int,
    fmt_size,
    machine,
    run_environment,
)
from bench_scaleout import LabNode, stop_nodes
from netlab import Host, NetLab, NetLabUnavailable, read_line

THIS = Path(__file__).resolve()
PORT = 7000
TENSOR_BYTES = 4 << 20
# The most written or read in one call (the calls of a version go at once): an answer of
# more than the client's max_frame_bytes is refused.
CALL_BYTES = 64 << 20
WAIT = 600.0  # a reader's long poll, and a call's timeout (seconds)
READY_TIMEOUT = 900.0  # the warm reads: K copies over one link, at worst


# ---------------------------------------------------------------------------
# Inside the lab: the control host and the readers


def names_of(model_bytes: int) -> list[str]:
    count = max(1, model_bytes // TENSOR_BYTES)
    return [f"layer{i:03d}.weight" for i in range(count)]


def _arrays(names: list[str], tensor_bytes: int, value: float) -> dict[str, np.ndarray]:
    return {n: np.full(tensor_bytes // 4, value, np.float32) for n in names}


async def writer(spec: dict[str, Any]) -> None:
    """Write version 1, then a new version at each line on stdin; print each write's
    acknowledgement time and version."""
    import asyncio

    from aioparamsync import ParameterClient

    names = names_of(spec["model_bytes"])
    tensor = min(TENSOR_BYTES, spec["model_bytes"])
    loop = asyncio.get_running_loop()
    async with ParameterClient(spec["address"], timeout=WAIT) as client:
        value = 1.0
        per_call = max(1, CALL_BYTES // tensor)  # (a message holds less than the frame limit)
        while True:
            arrays = _arrays(names, tensor, value)
            calls = [names[i : i + per_call] for i in range(0, len(names), per_call)]
            done = await asyncio.gather(
                *(client.update_arrays({n: arrays[n] for n in part}) for part in calls)
            )
            version = max(v for versions in done for v in versions.values())
            print(json.dumps({"acked": time.time(), "version": version}), flush=True)
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line.strip():
                return
            value += 1.0


async def reader(spec: dict[str, Any]) -> None:
    """Read version 1 (warm), say so, then each version asked for on stdin: print when
    the whole model at it was read."""
    import asyncio

    from aioparamsync import ParameterClient
    from aioparamsync.cli.taskdump import install as install_task_dump

    names = names_of(spec["model_bytes"])
    per_call = max(1, CALL_BYTES // min(TENSOR_BYTES, spec["model_bytes"]))
    calls = [names[i : i + per_call] for i in range(0, len(names), per_call)]
    loop = asyncio.get_running_loop()
    # (kill -USR1 a reader: its tasks' stacks on stderr, to see what a stuck one waits for)
    install_task_dump(loop)
    async with ParameterClient(spec["address"], timeout=WAIT) as client:

        async def read(version: int) -> int:
            got = await asyncio.gather(
                *(client.get_arrays(part, min_version=version, wait=WAIT) for part in calls)
            )
            return sum(len(arrays) for arrays in got)

        await read(1)
        print(json.dumps({"ready": time.time()}), flush=True)
        while line := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
            count = await read(int(line))
            done = time.time()
            assert count == len(names)
            print(json.dumps({"done": done}), flush=True)


def run_inside(role: str, text: str) -> int:
    from aioparamsync import run

    spec = json.loads(text)
    run(writer(spec) if role == "writer" else reader(spec))
    return 0


# ---------------------------------------------------------------------------
# The driver (outside the lab)


class Inside:
    """A ``--writer`` or ``--reader`` process on a lab host: lines in, JSON lines out."""

    def __init__(self, host: Host, role: str, spec: dict[str, Any], env: dict[str, str]) -> None:
        self.role = role
        self.err = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.proc = host.popen(
            [sys.executable, THIS, f"--{role}", json.dumps(spec)],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            preexec_fn=_die_with_parent,
        )

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{text}\n".encode())
        self.proc.stdin.flush()

    def line(self, deadline: float) -> dict[str, Any]:
        try:
            return json.loads(read_line(self.proc, deadline))
        except (RuntimeError, TimeoutError) as exc:
            self.err.seek(0)
            tail = self.err.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"{self.role}: {exc}\n{tail}") from None

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.send("")
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        self.err.close()


def node_cmd(host: Host, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "aioparamsync", "--host", host.ip, "--port", str(PORT),
        "--log-level", "warning", *flags,
    ]  # fmt: skip


def arrangement(
    name: str, lab: dict[str, Any], args: argparse.Namespace, env: dict[str, str]
) -> dict[str, Any]:
    """One arrangement, fresh processes: its rounds' times to all readers."""
    leader_host, follower_hosts = lab["leader"], lab["followers"]
    nodes = [LabNode(leader_host, 0, node_cmd(leader_host), env)]
    inside: list[Inside] = []
    try:
        leader = f"{leader_host.ip}:{PORT}"
        sources = [leader]
        if name == "tree":
            for i, host in enumerate(follower_hosts):
                nodes.append(LabNode(host, i + 1, node_cmd(host, "--follow", leader), env))
            sources = [f"{h.ip}:{PORT}" for h in follower_hosts]
        spec = {"model_bytes": args.model_bytes}
        write = Inside(lab["ctl"], "writer", {**spec, "address": leader}, env)
        inside.append(write)
        version = write.line(time.monotonic() + READY_TIMEOUT)["version"]
        readers = [
            Inside(host, "reader", {**spec, "address": sources[i % len(sources)]}, env)
            for i, host in enumerate(lab["readers"])
        ]
        inside += readers
        deadline = time.monotonic() + READY_TIMEOUT
        for r in readers:
            r.line(deadline)
        times = []
        busy0, t0 = machine_cpu_seconds()[0], time.monotonic()
        for _ in range(args.rounds):
            write.send("next")
            acked = write.line(time.monotonic() + WAIT)
            version = acked["version"]
            for r in readers:
                r.send(str(version))
            deadline = time.monotonic() + WAIT
            done = [r.line(deadline)["done"] for r in readers]
            times.append(max(done) - acked["acked"])
        busy = (machine_cpu_seconds()[0] - busy0) / (time.monotonic() - t0)
    finally:
        for p in inside:
            p.stop()
        stop_nodes(nodes)
    median = statistics.median(times)
    return {
        "arrangement": name,
        "followers": len(sources) if name == "tree" else 0,
        "readers": len(lab["readers"]),
        "seconds": times,
        "median_seconds": median,
        "readers_bytes_per_s": len(lab["readers"]) * args.model_bytes / median,
        "busy": busy,
    }


_SIZES = {"": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def model_size(text: str) -> int:
    """``8MiB``, ``256MiB``, ``1GiB`` (any size: the model is many tensors)."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZES or int(match.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 8MiB, 256MiB, 1GiB)")
    return int(match.group(1)) * _SIZES[unit]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--readers", type=_positive_int, default=8, help="reader hosts (8)")
    p.add_argument("--followers", type=_positive_int, default=2, help="followers (2)")
    p.add_argument("--model-bytes", type=model_size, default=256 << 20, help="the model (256MiB)")
    p.add_argument("--mbit", type=_positive_float, default=300.0, help="every link (300)")
    p.add_argument("--rounds", type=_positive_int, default=2, help="new versions (2)")
    p.add_argument(
        "--arrangements", default="one-node,tree", help="one-node, tree, or both (default)"
    )
    p.add_argument("--json", help="write the results here too")
    p.add_argument("--writer", help=argparse.SUPPRESS)
    p.add_argument("--reader", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.writer or args.reader:
        return run_inside("writer" if args.writer else "reader", args.writer or args.reader)
    chosen = [a.strip() for a in args.arrangements.split(",") if a.strip()]
    if not chosen or any(a not in ("one-node", "tree") for a in chosen):
        print("bad --arrangements: one-node, tree, or both", file=sys.stderr)
        return 2
    if args.model_bytes < 4:
        print("--model-bytes is at least 4 bytes", file=sys.stderr)
        return 2
    env = run_environment("system", THIS, reexec=argv is None)
    if env is None:
        return 2
    rows = []
    try:
        with NetLab() as lab:
            hosts = {
                "leader": lab.host("leader", mbit=args.mbit),
                "followers": [lab.host(f"f{i}", mbit=args.mbit) for i in range(args.followers)],
                "readers": [lab.host(f"r{i}", mbit=args.mbit) for i in range(args.readers)],
                "ctl": lab.host("ctl"),
            }
            tag = lab.tag
            for name in chosen:
                row = arrangement(name, hosts, args, env)
                rows.append(row)
                print(
                    f"{name}: {row['median_seconds']:.2f} s to all {row['readers']} readers "
                    f"(rounds {', '.join(f'{s:.2f}' for s in row['seconds'])}), busy "
                    f"{row['busy']:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
    except NetLabUnavailable as exc:
        print(f"bench_fanout: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; the lab was torn down", file=sys.stderr)
        return 130
    meta = machine()
    meta |= {"lab": tag, "mbit": args.mbit, "model_bytes": args.model_bytes}
    meta |= {"rounds": args.rounds}
    print(f"\naioparamsync at {meta['git']}; links {args.mbit:g} Mbit/s each way (htb)")
    print(f"a new {fmt_size(args.model_bytes)} model version to {args.readers} readers:\n")
    print("| arrangement | time to all readers | readers' MB/s | vs one node | busy |")
    print("|---|---|---|---|---|")
    base = next((r["median_seconds"] for r in rows if r["arrangement"] == "one-node"), None)
    for r in rows:
        label = r["arrangement"] + (f" ({r['followers']} followers)" if r["followers"] else "")
        ratio = f"{base / r['median_seconds']:.2f}x" if base else "-"
        print(
            f"| {label} | {r['median_seconds']:.2f} s | "
            f"{r['readers_bytes_per_s'] / 1e6:.1f} | {ratio} | {r['busy']:.2f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
