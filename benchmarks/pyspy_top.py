#!/usr/bin/env python3
"""Where the time goes, by function, from a ``py-spy record --format raw`` file.

::

    py-spy record --pid PID --duration 20 --format raw -o node.txt
    python benchmarks/pyspy_top.py node.txt [--top 25]

py-spy's raw format is one line per distinct stack, ``frame;frame;...;leaf COUNT``,
each frame ``function (file:line)``. This prints, per function (file and
function, lines merged): ``self``, the share of samples where it was the leaf
(the frame on the CPU), and ``total``, the share of samples where it was
anywhere on the stack (counted once per sample).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>.*?)(?::\d+)?\)$")


def function_of(frame: str) -> str:
    """``name (path/to/file.py:123)`` -> ``name (file.py)``; other frames as they are."""
    match = _FRAME.match(frame.strip())
    if not match:
        return frame.strip()
    path = match.group("file")
    short = "/".join(path.split("/")[-2:]) if "/" in path else path
    return f"{match.group('func')} ({short})"


def summarize(lines: list[str]) -> tuple[int, Counter[str], Counter[str]]:
    total = 0
    self_counts: Counter[str] = Counter()
    total_counts: Counter[str] = Counter()
    for line in lines:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        stack, _, count_text = line.rpartition(" ")
        try:
            count = int(count_text)
        except ValueError:
            continue
        frames = [function_of(f) for f in stack.split(";") if f.strip()]
        if not frames:
            continue
        total += count
        self_counts[frames[-1]] += count
        for func in set(frames):
            total_counts[func] += count
    return total, self_counts, total_counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("raw", help="a py-spy --format raw file")
    p.add_argument("--top", type=int, default=25, help="lines per table (default: %(default)s)")
    args = p.parse_args(argv)
    with open(args.raw) as f:
        total, self_counts, total_counts = summarize(f.readlines())
    if not total:
        print("no samples", file=sys.stderr)
        return 1
    print(f"{total} samples\n")
    print("| self % | function |")
    print("|---:|---|")
    for func, n in self_counts.most_common(args.top):
        print(f"| {100 * n / total:5.1f} | `{func}` |")
    print("\n| total % | function |")
    print("|---:|---|")
    for func, n in total_counts.most_common(args.top):
        print(f"| {100 * n / total:5.1f} | `{func}` |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
