"""A node process keeps the memory it frees (``aioparamsync.cli.memory``)."""

from __future__ import annotations

import contextlib
import gc
import subprocess
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

CHILD = """
import ctypes, numpy as np
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
from aioparamsync.cli.memory import keep_freed_memory
import sys
if sys.argv[1] == "kept":
    assert keep_freed_memory()
before = libc.mallinfo2().hblkhd
a = np.ones(16 << 20, np.uint8)  # 16 MiB: from mmap by default, from the heap once kept
mapped = libc.mallinfo2().hblkhd - before
del a
b = np.ones(16 << 20, np.uint8)
print(mapped, libc.mallinfo2().arena >= 16 << 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_node_process_takes_large_blocks_from_the_heap_and_keeps_them() -> None:
    def run(mode: str) -> list[str]:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    mapped, in_heap = run("kept")
    assert int(mapped) == 0 and in_heap == "True"  # (kept: from the heap, reused)
    mapped, _ = run("default")
    assert int(mapped) >= 16 << 20  # (glibc's default: a block of its own, mapped)


# (main() as aioparamsync-node runs it, up to where it would serve: uvloop.run reports the
# collector's state instead, and a cycle made before collect_less is checked collected)
COLLECTOR_CHILD = """
import gc, sys, weakref
import uvloop
from aioparamsync.cli import node

class Cycle:
    pass

c = Cycle()
c.me = c
gone = weakref.ref(c)
del c

def report(coro):
    coro.close()
    print(gc.get_freeze_count() > 10_000, gc.get_threshold()[0], gone() is None)
    return 0

uvloop.run = report
sys.exit(node.main(sys.argv[1:]))
"""


def test_a_node_process_freezes_what_it_made_before_it_serves_and_collects_less_often() -> None:
    from aioparamsync.cli.memory import YOUNGEST_THRESHOLD

    argv = [sys.executable, "-c", COLLECTOR_CHILD, "--host", "127.0.0.1", "--port", "0"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", str(YOUNGEST_THRESHOLD), "True"]
    # A program that imports the package keeps Python's own settings.
    plain = "import gc, aioparamsync; print(gc.get_freeze_count(), gc.get_threshold()[0])"
    out = subprocess.run([sys.executable, "-c", plain], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", str(gc.get_threshold()[0])]


# -- the buffer of a large frame, kept for the next -----------------------------------------


def test_a_frame_buffer_is_reused_only_once_no_one_holds_it() -> None:
    from aioparamsync.wire.framing import _Kept

    kept = _Kept()
    first = kept.take(1000)
    assert first.base is None  # (new)
    held = kept.take(1000)
    assert held.base is None and held is not first  # (the first is held: a new one)
    del first, held
    again = kept.take(900)
    assert again.base is not None and len(again) == 900  # (a view of the one kept)
    assert kept.take(900).base is None  # (that one is held again)
    small = kept.take(100)  # (kept, but it would waste over half of it: a new one)
    assert small.base is None


async def test_a_push_lets_its_frame_go_once_folded() -> None:
    """The node keeps nothing of a push once it has answered it: not its frame through the
    store's writer (its last batch), nor through the reply the push ledger keeps. So the
    next push is received into the same buffer (not into new memory the kernel zeroes)."""
    import numpy as np

    from aioparamsync import Node, ParameterClient, sgd
    from aioparamsync.wire import framing

    names = [f"w{i}" for i in range(4)]
    async with Node("127.0.0.1", 0) as node, ParameterClient(node.address) as client:
        await client.update_arrays({n: np.zeros(1 << 20, np.float32) for n in names}, rules=sgd(1))
        grads = {n: np.ones(1 << 20, np.float32) for n in names}
        for _ in range(3):
            await client.push_gradients(grads)
            buffer = framing._kept.buffer
            assert buffer is not None and len(buffer) > 16 << 20
            assert sys.getrefcount(buffer) == 3  # (kept, here, and the call's argument)
            del buffer
        assert (await client.get_arrays(["w0"]))["w0"][0] == -3


# -- a refused call keeps nothing of its bytes ------------------------------------------------


@contextlib.contextmanager
def collector_off() -> Iterator[list[Any]]:
    """Python's garbage collector off within; then the list it yields holds what a
    collection finds: the objects only a reference cycle kept."""
    gc.collect()
    gc.disable()
    found: list[Any] = []
    try:
        yield found
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found.extend(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def ours(garbage: list[Any], min_bytes: int) -> tuple[list[str], int]:
    """The frames of aioparamsync's code among ``garbage``, and how many buffers of at
    least ``min_bytes`` it holds."""
    frames = [
        f"{o.f_code.co_filename}:{o.f_code.co_name}"
        for o in garbage
        if isinstance(o, types.FrameType) and "aioparamsync" in o.f_code.co_filename
    ]
    large = sum(1 for o in garbage if isinstance(o, memoryview) and o.nbytes >= min_bytes)
    return frames, large


@pytest.mark.parametrize("elements", [1 << 16, 3 << 20])  # (256 KiB; 12 MiB: in partitions)
async def test_a_refused_write_leaves_nothing_of_its_bytes_to_the_garbage_collector(
    elements: int,
) -> None:
    """A refused write's traceback held the frames it passed through (the writer's batch,
    the handlers' decoded values), and one of them the future set with it: a cycle that
    kept the request's bytes until the collector's next pass (15 refused 64 MiB writes
    left ~960 MiB behind with the collector off). Every kind of write refused, each
    kind twice; then nothing of theirs is garbage in a cycle."""
    import numpy as np

    from aioparamsync import Node, ParameterClient, RequestError, sgd

    async with Node("127.0.0.1", 0) as node, ParameterClient(node.address) as client:
        await client.update_arrays({"w": np.zeros(elements, np.float32)}, rules=sgd(1))
        await client.update_arrays({"plain": np.zeros(elements, np.float32)})
        bad = np.ones(elements, np.float32)
        bad[-1] = np.nan
        refused = [
            lambda: client.update_arrays({"w": np.zeros((elements // 4, 4), np.float32)}),
            lambda: client.update_arrays({"w": np.zeros(elements, np.float64)}),
            lambda: client.push_gradients({"plain": np.ones(elements, np.float32)}),
            lambda: client.push_gradients({"nope": np.ones(elements, np.float32)}),
            lambda: client.push_gradients({"w": bad}),
            lambda: client.push_gradients({"w": np.ones(elements + 1, np.float32)}),
        ]
        with collector_off() as garbage:
            for call in refused * 2:
                with pytest.raises(RequestError):
                    await call()
        frames, large = ours(garbage, 1 << 16)
        assert not frames and not large, (frames[:10], large)
        assert (await client.get_arrays(["w"]))["w"].sum() == 0  # (nothing was applied)


async def test_a_refused_write_whose_connection_then_closes_leaves_nothing_behind() -> None:
    """The last write's future, done, stays on its connection for the read-your-writes of
    the next call; the connection closed (the client gone, or moved to the node's Unix
    socket), it held the connection through the write's call: a cycle that kept the
    future's traceback and, in its frames, the refused request's bytes."""
    import numpy as np

    from aioparamsync import Node, ParameterClient, RequestError, sgd

    elements = 3 << 20  # (12 MiB: in partitions)
    async with Node("127.0.0.1", 0) as node:
        async with ParameterClient(node.address, shared_memory=0) as setup:
            await setup.update_arrays({"w": np.zeros(elements, np.float32)}, rules=sgd(1))
        with collector_off() as garbage:
            for _ in range(3):
                async with ParameterClient(node.address, route=False, shared_memory=0) as c:
                    with pytest.raises(RequestError):
                        await c.update_arrays({"w": np.zeros((elements // 4, 4), np.float32)})
            await eventually_no_connections(node)
        frames, large = ours(garbage, 1 << 16)
        assert not frames and not large, (frames[:10], large)


async def eventually_no_connections(node: Any) -> None:
    from cluster_helpers import assert_, eventually

    await eventually(lambda: assert_(not node.server.connections), timeout=10, interval=0.01)


async def test_a_timed_out_call_leaves_nothing_of_its_bytes_to_the_garbage_collector() -> None:
    """The client's side: a call that timed out held its error in its future, whose
    traceback held the frame that awaited it, which held the future and the request (the
    caller's 16 MiB): a cycle. Pushes, updates and reads, pooled and held, each timed out;
    and the node's side of the connections the client then closed."""
    import numpy as np

    from aioparamsync import CallTimeout, Node, ParameterClient, sgd

    elements = 4 << 20
    async with Node("127.0.0.1", 0) as node, ParameterClient(node.address) as client:
        await client.update_arrays({"w": np.zeros(elements, np.float32)}, rules=sgd(1))
        calls = [
            lambda: client.push_gradients({"w": np.ones(elements, np.float32)}, timeout=1e-4),
            lambda: client.update_arrays({"w": np.ones(elements, np.float32)}, timeout=1e-4),
            lambda: client.get_arrays(["w"], timeout=1e-4),
            # (held by the node, on a connection of its own: the spare one the call below
            # leaves, so the deadline falls on the call, not on its connect)
            lambda: client.get_arrays(["w"], min_version=10**6, wait=5.0, timeout=0.05),
        ]
        await client.get_arrays(["w"], wait=5.0)  # (answered at once: its connection kept)
        with collector_off() as garbage:
            for call in calls * 2:
                with pytest.raises(CallTimeout):
                    await call()
        frames, large = ours(garbage, 1 << 20)
        assert not frames and not large, (frames[:10], large)
        served = [o for o in garbage if type(o).__name__ == "ServerConnection"]
        assert not served  # (the node's end of the closed connections, and its buffers)


async def test_refused_writes_through_a_cluster_leave_nothing_of_their_bytes_behind() -> None:
    """A routed client's write cut over two nodes, refused: the parts' errors came back
    through gathers that held them in frames their tracebacks held, and an error the
    routing had nothing to add to was raised ``from`` itself. 6 refused writes of 48 MiB
    left 512 MiB of cyclic garbage with the collector off. (R=2: the parts' replicas
    too; R=1 failed alike before the change.)"""
    import numpy as np
    from cluster_helpers import LocalCluster

    from aioparamsync import ParameterClient, RequestError, sgd

    cluster = LocalCluster(replication_factor=2)
    try:
        a = await cluster.start()
        b = await cluster.start(peers=[a])
        await cluster.formed([a, b])
        elements = 2 << 20  # (8 MiB: in partitions, over both nodes)
        names = [f"w{i}" for i in range(6)]
        async with ParameterClient(a.address) as client:
            await client.update_arrays(
                {n: np.zeros(elements, np.float32) for n in names}, rules=sgd(1), acks="all"
            )
            refused = [
                lambda: client.update_arrays(
                    {n: np.zeros((elements // 2, 2), np.float32) for n in names}
                ),
                lambda: client.push_gradients(
                    {n: np.ones(elements + 1, np.float32) for n in names}
                ),
                lambda: client.push_gradients(
                    {"nope": np.ones(elements, np.float32)}
                    | {n: np.ones(elements, np.float32) for n in names},
                    acks="all",
                ),
            ]
            with collector_off() as garbage:
                for call in refused * 2:
                    with pytest.raises(RequestError):
                        await call()
            frames, large = ours(garbage, 1 << 20)
            assert not frames and not large, (frames[:10], large)
    finally:
        await cluster.close()
