"""``aioparamsync-ctl checkpoint`` and ``restore``: the cluster at one cut, and back.

The work is :mod:`aioparamsync.client.checkpoint`'s; this is its command line.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..client.checkpoint import MAX_HOLD_MS, checkpoint
from ..client.restore import restore
from .output import format_size, print_json

__all__ = ["add_parsers", "run_checkpoint", "run_restore"]


def add_parsers(command: Any) -> None:
    """The commands' arguments, on the parsers ``command(name, summary)`` makes."""
    take = command(
        "checkpoint",
        "write every parameter and table of the cluster into a new directory, at one cut: "
        "of every update call, all of its parameters or none",
    )
    take.add_argument("directory", type=Path, metavar="DIR", help="a new (or empty) directory")
    take.add_argument(
        "--hold",
        type=_hold_ms,
        default=10_000,
        metavar="MS",
        help="the longest each node holds writes while the cut is made; past it the node "
        "lets them in and the checkpoint fails (default: 10000)",
    )
    take.set_defaults(route=True)
    back = command(
        "restore",
        "write a checkpoint into the cluster (of any size) through the normal write path",
    )
    back.add_argument("directory", type=Path, metavar="DIR", help="a checkpoint's directory")
    back.set_defaults(route=True)


def _hold_ms(text: str) -> int:
    try:
        ms = int(text)
    except ValueError:
        ms = 0
    if not 0 < ms <= MAX_HOLD_MS:
        raise argparse.ArgumentTypeError(f"a whole number of ms from 1 to {MAX_HOLD_MS}")
    return ms


def _summary(manifest: dict[str, Any]) -> tuple[int, int, int]:
    params = manifest["parameters"]
    rows = sum(int(t["rows"]) for t in manifest["tables"].values())
    return len(params), sum(int(p["nbytes"]) for p in params.values()), rows


async def run_checkpoint(client: Any, args: argparse.Namespace) -> int:
    manifest = await checkpoint(client, args.directory, hold_ms=args.hold)
    n, size, rows = _summary(manifest)
    torn = manifest["torn_calls"]
    if args.json:
        print_json(
            {
                "directory": str(args.directory),
                "cut": manifest["cut"],
                "parameters": n,
                "bytes": size,
                "tables": len(manifest["tables"]),
                "rows": rows,
                "torn_calls": torn,
            }
        )
    else:
        print(
            f"wrote {n} parameters ({format_size(size)}) and {len(manifest['tables'])} tables "
            f"({rows} rows) to {args.directory}, at cut {manifest['cut']}"
            + (f"; {len(torn)} calls torn (their writers stopped amid them)" if torn else "")
        )
    return 0


async def run_restore(client: Any, args: argparse.Namespace) -> int:
    manifest = await restore(client, args.directory)
    n, size, rows = _summary(manifest)
    if args.json:
        print_json(
            {
                "directory": str(args.directory),
                "parameters": n,
                "bytes": size,
                "tables": len(manifest["tables"]),
                "rows": rows,
            }
        )
    else:
        print(
            f"restored {n} parameters ({format_size(size)}) and {len(manifest['tables'])} "
            f"tables ({rows} rows) from {args.directory}"
        )
    return 0
