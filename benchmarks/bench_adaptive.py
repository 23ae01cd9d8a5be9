#!/usr/bin/env python3
"""Time to a target loss per gradient encoding and for ``encoding="auto"``, fast and slow links.

One command::

    python benchmarks/bench_adaptive.py [--dim 262144] [--compute-ms 10]
                                        [--mbit 100] [--rtt-ms 5] [--goal 1e-3]
                                        [--max-steps 200] [--json out.json] [--plot out.png]

A node in this process on 127.0.0.1, and one worker training a float32
parameter of ``--dim`` values by ``sgd(1.0)``, on a quadratic whose curvatures
spread over a decade (``loss = 0.5 * sum(h * (w - w*)**2)``, h in [0.1, 1];
the loss falls ~0.8x a step uncompressed). Each step the worker reads ``w``
(raw), spends ``--compute-ms`` computing (a sleep, then the gradient, as
a model's forward and backward would), and pushes its gradient with the
encoding under test: none, bf16, int8, topk 10%, topk 1% (bounded: see
values/feedback.py) and auto (``target=0.2``). It stops at ``--goal`` times the
initial loss, or after ``--max-steps``.

Two links: ``fast`` (loopback as it is) and ``slow`` (through
benchmarks/throttle.py at ``--mbit`` each way and ``--rtt-ms`` added).
Reported per (link, encoding): wall seconds to the goal, steps, the final loss
ratio, bytes sent; for auto, what it chose (counts), and its seconds as a
ratio to the best fixed encoding that reached the goal (<= 1.10 is the aim).
One run per cell, on a machine that may be busy: read the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throttle import Throttle

from aioparamsync import Node, ParameterClient, sgd
from aioparamsync.values.adaptive import PUSH_CHOICES

__all__ = ["PUSH_CHOICES", "problem", "time_to_goal"]

ENCODINGS: dict[str, dict[str, Any]] = {
    "none": {},
    "bf16": {"encoding": "bf16"},
    "int8": {"encoding": "int8"},
    "topk 10%": {"encoding": "topk", "ratio": 0.1},
    "topk 1%": {"encoding": "topk", "ratio": 0.01},
    "auto": {"encoding": "auto"},
}


def problem(dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The curvatures ``h`` (a decade, shuffled) and the optimum ``w*``."""
    rng = np.random.default_rng(seed)
    h = rng.permutation(np.logspace(0, -1, dim)).astype(np.float32)
    return h, rng.standard_normal(dim).astype(np.float32)


def loss_of(w: np.ndarray, h: np.ndarray, star: np.ndarray) -> float:
    d = (w - star).astype(np.float64)
    return float(0.5 * np.sum(h * d * d))


async def time_to_goal(
    address: str,
    name: str,
    push: dict[str, Any],
    *,
    dim: int,
    compute: float,
    goal: float,
    max_steps: int,
    client: ParameterClient | None = None,
) -> dict[str, Any]:
    """Train ``name`` from zero until its loss is ``goal`` of the initial one."""
    h, star = problem(dim)
    own = client is None
    c = client or ParameterClient(address, timeout=60)
    try:
        w = np.zeros(dim, np.float32)
        await c.update_arrays({name: w}, rules=sgd(1.0))
        first = loss_of(w, h, star)
        sent0 = c.traffic["bytes_sent"]
        started = time.monotonic()
        steps, ratio = 0, 1.0
        while steps < max_steps:
            w = (await c.get_arrays([name]))[name]
            ratio = loss_of(w, h, star) / first
            if ratio <= goal or not np.isfinite(ratio):
                break
            await asyncio.sleep(compute)
            await c.push_gradients({name: h * (w - star)}, **push)
            steps += 1
        seconds = time.monotonic() - started
        out: dict[str, Any] = {
            "seconds": seconds,
            "steps": steps,
            "loss_ratio": ratio,
            "reached": ratio <= goal,
            "bytes_sent": c.traffic["bytes_sent"] - sent0,
        }
        auto = c.stats().get("auto")
        if push.get("encoding") == "auto" and auto is not None:
            out["chosen"] = auto["counts"]
        return out
    finally:
        if own:
            await c.close()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    async with Node("127.0.0.1", 0) as node:
        for link in ("fast", "slow"):
            throttle = None
            address = node.address
            if link == "slow":
                throttle = Throttle(node.address, mbit=args.mbit, rtt_ms=args.rtt_ms)
                await throttle.__aenter__()
                address = throttle.address
            try:
                cells = {}
                for label, push in ENCODINGS.items():
                    cells[label] = await time_to_goal(
                        address,
                        f"{link}/{label}",
                        push,
                        dim=args.dim,
                        compute=args.compute_ms / 1000,
                        goal=args.goal,
                        max_steps=args.max_steps,
                    )
                    print(link, label, json.dumps(cells[label]), flush=True)
                fixed = [v["seconds"] for k, v in cells.items() if k != "auto" and v["reached"]]
                if fixed and cells["auto"]["reached"]:
                    cells["auto"]["vs_best_fixed"] = cells["auto"]["seconds"] / min(fixed)
                results[link] = cells
            finally:
                if throttle is not None:
                    await throttle.__aexit__(None, None, None)
    return results


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.5))
    for ax, (link, cells) in zip(np.atleast_1d(axes), results.items(), strict=True):
        labels = list(cells)
        ax.bar(labels, [cells[k]["seconds"] for k in labels])
        ax.set_title(f"{link} link: seconds to the goal")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=262144)
    parser.add_argument("--compute-ms", type=float, default=10.0)
    parser.add_argument("--mbit", type=float, default=100.0)
    parser.add_argument("--rtt-ms", type=float, default=5.0)
    parser.add_argument("--goal", type=float, default=1e-3)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args()
    if args.dim < 1 or args.max_steps < 1 or not 0 < args.goal < 1:
        parser.error("--dim and --max-steps are >= 1, --goal in (0, 1)")
    results = asyncio.run(run(args))
    for link, cells in results.items():
        for label, cell in cells.items():
            extra = f"  chose {cell['chosen']}" if "chosen" in cell else ""
            vs = f"  {cell['vs_best_fixed']:.2f}x best fixed" if "vs_best_fixed" in cell else ""
            print(
                f"{link:4} {label:9} {cell['seconds']:7.2f} s  {cell['steps']:4} steps  "
                f"loss {cell['loss_ratio']:.1e}  {cell['bytes_sent'] / 1e6:8.1f} MB sent{vs}{extra}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
