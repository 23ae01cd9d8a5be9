#!/usr/bin/env python3
"""The work per tensor of a step of many small tensors, in one process, without sockets.

Workload B of ``bench_peers.py`` pulls and pushes 200 tensors of 4 KiB a step: the node
and the client then spend most of their time on what they do once per tensor. This
script times those parts alone (``timeit``, the best of ``--reps`` repetitions of
``--number`` calls, divided by ``--count`` tensors):

* ``fold``: the store's fold of a push (``ParameterTable.fold``, ``sgd``): its checks,
  the compiled fold, the new entries;
* ``answer``: the node's answer to a pull (each entry's ``Parameter``, the message
  encoded), ``rules`` as a plain read gets them, ``no rules`` as ``get_arrays`` asks
  (``ParameterRequest.without_rules``);
* ``decode``: the client's decode of that answer, both ways;
* ``to_parameter``: a gradient made a ``Parameter`` (its dtype sent before);
* ``from_parameter``: a pulled ``Parameter`` made an array;
* ``answer, blocks`` and ``decode, blocks``: the same answer in blocks (``Packed``, as
  ``get_arrays`` asks a node for it), and its decode into arrays;
* ``push, one each`` and ``push, blocks``: the client's push message made and encoded,
  one ``Parameter`` a gradient or the gradients in blocks (``GradientPush.packed``);
* ``push read, one each`` and ``push read, blocks``: the node's decode of it, to the
  ``Parameter`` of each gradient the fold takes.

::

    python benchmarks/bench_tensors.py                    # 200 x 4 KiB float32
    python benchmarks/bench_tensors.py --elements 262144  # 200 x 1 MiB
    python benchmarks/bench_tensors.py --json tensors.json

On the compiled path where it was built (``AIOPARAMSYNC_NO_EXT=1``: the pure one), with
glibc's malloc set as a node sets it (``cli/memory.py``: freed memory kept for reuse).
One core, no I/O: the floor of what each part costs on this machine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import timeit
from collections.abc import Callable
from typing import Any

import numpy as np

from aioparamsync import sgd, thrift
from aioparamsync._ext import compiled
from aioparamsync.cli.memory import keep_freed_memory
from aioparamsync.store.table import ParameterTable
from aioparamsync.values.arrays import from_parameter, to_parameter
from aioparamsync.wire.codec import BinaryReader, encode_message

PARTS = ("fold", "answer, rules", "answer, no rules", "decode, rules", "decode, no rules")
PARTS += ("to_parameter", "from_parameter", "answer, blocks", "decode, blocks")
PARTS += ("push, one each", "push, blocks", "push read, one each", "push read, blocks")


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"at least 1, not {value}")
    return value


def per_tensor(run: Callable[[], object], count: int, number: int, reps: int) -> float:
    """Microseconds a tensor: the best of ``reps`` times ``number`` calls of ``run``."""
    return min(timeit.repeat(run, number=number, repeat=reps)) / number / count * 1e6


def measure(count: int, elements: int, number: int, reps: int) -> dict[str, float]:
    names = [f"layer{i}.weight" for i in range(count)]
    table = ParameterTable("node")
    stored = [to_parameter(n, np.zeros(elements, np.float32)) for n in names]
    for p in stored:
        p.rule = sgd(0.01)
    table.apply(stored, 1)
    grads = [to_parameter(n, np.full(elements, 1e-3, np.float32)) for n in names]
    held = [e for e in map(table.entry, names) if e is not None]
    stamp = [1]

    def fold() -> None:
        stamp[0] += 1
        table.fold(grads, stamp[0])

    def answer(rules: bool) -> Callable[[], Any]:
        def run() -> Any:
            params = [e.to_parameter() if rules else e.to_parameter(False) for e in held]
            response = thrift.ParameterResponse(params=params, timestamp=1)
            return encode_message("pull_parameters", 2, 1, response)

        return run

    def decoded(message: Callable[[], Any], cls: Any, then: Any = None) -> Callable[[], Any]:
        parts, _ = message()
        frame = memoryview(b"".join(bytes(p) for p in parts))[4:]  # (less the frame's length)

        def run() -> Any:
            reader = BinaryReader(frame)
            reader.read_message_begin()
            body = reader.read_body(cls)
            return body if then is None else then(body)

        return run

    def decode(rules: bool) -> Callable[[], Any]:
        return decoded(answer(rules), thrift.ParameterResponse)

    arrays = [np.full(elements, 0.5, np.float32) for _ in names]
    pulled = decode(True)().params

    def make() -> None:
        for n, a in zip(names, arrays, strict=True):
            to_parameter(n, a)

    def read() -> None:
        for p in pulled:
            from_parameter(p)

    try:
        from aioparamsync.values import packing
    except ImportError:  # (a tree before blocks: those parts are n/a)
        packing = None
    gradients = dict(zip(names, arrays, strict=True))
    pushed = thrift.ParameterSyncService.push_gradients_args

    def answer_blocks() -> Any:
        response = packing.packed_response(held, 1)
        return encode_message("pull_parameters", 2, 1, response)

    def push(blocks: bool) -> Callable[[], Any]:
        def run() -> Any:
            if blocks:
                packed, _ = packing.pack_arrays(gradients)
                each = []
            else:
                packed, each = None, [to_parameter(n, a) for n, a in gradients.items()]
            message = thrift.GradientPush(grads=each, packed=packed, request_id="r")
            return encode_message("push_gradients", 1, 1, pushed(push=message))

        return run

    def made(body: Any) -> Any:
        return packing.gradients_of(body.push.packed)

    try:
        held[0].to_parameter(False)  # type: ignore[call-arg]
    except TypeError:  # (a tree before ParameterRequest.without_rules: those parts are n/a)
        without = False
    else:
        without = True
    runs: dict[str, Callable[[], object] | None] = {
        "fold": fold,
        "answer, rules": answer(True),
        "answer, no rules": answer(False) if without else None,
        "decode, rules": decode(True),
        "decode, no rules": decode(False) if without else None,
        "to_parameter": make,
        "from_parameter": read,
        "answer, blocks": answer_blocks if packing else None,
        "decode, blocks": decoded(answer_blocks, thrift.ParameterResponse, packing.arrays_of)
        if packing
        else None,
        "push, one each": push(False) if packing else None,
        "push, blocks": push(True) if packing else None,
        "push read, one each": decoded(push(False), pushed) if packing else None,
        "push read, blocks": decoded(push(True), pushed, made) if packing else None,
    }
    return {
        part: math.nan if runs[part] is None else per_tensor(runs[part], count, number, reps)
        for part in PARTS
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=positive, default=200, help="tensors (default: 200)")
    parser.add_argument(
        "--elements", type=positive, default=1024, help="float32 elements a tensor (default: 1024)"
    )
    parser.add_argument("--number", type=positive, default=100, help="calls a rep (default: 100)")
    parser.add_argument("--reps", type=positive, default=7, help="repetitions (default: 7)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures here")
    args = parser.parse_args(argv)
    path = "compiled" if compiled("values._cfold") is not None else "pure"
    keep_freed_memory()  # (as a node does)
    figures = measure(args.count, args.elements, args.number, args.reps)
    print(f"{args.count} x {args.elements * 4} bytes float32, {path} path, best of {args.reps}")
    width = max(map(len, PARTS))
    for part, us in figures.items():
        print(f"{part:<{width}}  {us:8.2f} us a tensor" if us == us else f"{part:<{width}}  n/a")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"count": args.count, "elements": args.elements, "path": path, **figures}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
