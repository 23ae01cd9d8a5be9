"""Durability: the write-ahead log, snapshots and recovery, on real files and real processes.

Crashes are real: a node process started with ``python -m aioparamsync --port 0
--data-dir D`` on 127.0.0.1 and killed with SIGKILL (by its PID). Everything
else runs a :class:`Node` in this process on port 0. A "crash image" of a
running in-process node is a copy of its data directory taken between two of
its writer's steps (the copy runs on the event loop, so no batch is half
written): what a ``kill -9`` at that moment would leave on disk.

Every node started here is stopped or killed at teardown, and every wait is
bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import threading
import time
import zlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from cluster_helpers import CALL_TIMEOUT, NODE_COMMAND, START_TIMEOUT, NodeProcess, Spawn

from aioparamsync import ErrorCode, Node, ParameterClient, ParamSyncError, RequestError, thrift
from aioparamsync.persistence import datadir as persistence
from aioparamsync.persistence.datadir import DataDir, PersistenceError
from aioparamsync.store.table import ParameterTable
from aioparamsync.values import pieces

pytestmark = pytest.mark.timeout(60)

NODE = NODE_COMMAND
# A node with a data directory writes a snapshot as it exits: more time than elsewhere.
EXIT_TIMEOUT = 15.0
MIB = 1024 * 1024
RECORD = struct.Struct("!II")  # the log's record header: length, crc32
SEGMENT = re.compile(r"wal-(\d{8})\.log")
SNAPSHOT = re.compile(r"snapshot-(\d{8})\.json")

# name -> (version, origin, dtype, shape, bytes): what a node holds.
State = dict[str, tuple[int, str, str | None, tuple[int, ...] | None, bytes]]


async def terminate(node: NodeProcess) -> int:
    node.proc.send_signal(signal.SIGTERM)
    return await node.wait_exit(EXIT_TIMEOUT)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Run a node that is expected to exit by itself (killed if it outlives the timeout)."""
    return subprocess.run(
        [*NODE, "--port", "0", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT,
        check=False,
    )


def client_of(address: tuple[str, int]) -> ParameterClient:
    return ParameterClient(address, timeout=CALL_TIMEOUT, connect_timeout=5.0)


# -- in-process nodes, states, files -------------------------------------------------------


@contextlib.asynccontextmanager
async def running(data_dir: Path, **kwargs: Any) -> AsyncIterator[Node]:
    """A started in-process node on 127.0.0.1:0 with ``data_dir``; stopped at the end."""
    kwargs.setdefault("fsync", "always")
    node = Node("127.0.0.1", 0, data_dir=data_dir, **kwargs)
    await node.start()
    try:
        yield node
    finally:
        await node.stop(grace=1.0)


def table_state(table: ParameterTable) -> State:
    state: State = {}
    for name in table.names():
        e = table.entry(name)
        assert e is not None
        state[name] = (e.version, e.origin, e.dtype, e.shape, bytes(e.data))
    return state


def params_state(params: Any) -> State:
    return {
        p.name: (
            p.version,
            p.origin,
            p.dtype,
            tuple(p.shape) if p.shape is not None else None,
            bytes(p.data),
        )
        for p in params
    }


async def read_state(client: ParameterClient, names: list[str]) -> State:
    return params_state((await client.get_parameters(names)).params)


def recover_into_table(path: Path, **kwargs: Any) -> tuple[State, persistence.Recovered]:
    """Recover ``path`` with a bare DataDir (as a node would) and close it again."""
    table = ParameterTable("recovery")
    data_dir = DataDir(path, **kwargs)
    try:
        found = data_dir.recover(table)
    finally:
        data_dir.close()
    return table_state(table), found


def crash_image(src: Path, dst: Path) -> Path:
    """What a kill -9 now would leave: a copy of the running node's data directory."""
    shutil.copytree(src, dst)
    return dst


def segment_numbers(path: Path) -> list[int]:
    return sorted(int(m[1]) for p in path.iterdir() if (m := SEGMENT.fullmatch(p.name)))


def snapshot_numbers(path: Path) -> list[int]:
    return sorted(int(m[1]) for p in path.iterdir() if (m := SNAPSHOT.fullmatch(p.name)))


def segment_path(path: Path, n: int) -> Path:
    return path / f"wal-{n:08d}.log"


def record_spans(data: bytes) -> list[tuple[int, int]]:
    """(offset, total size) of each record of a segment; every record must be whole."""
    spans = []
    pos = 0
    while pos < len(data):
        length, crc = RECORD.unpack_from(data, pos)
        end = pos + RECORD.size + length
        assert end <= len(data), f"a record at byte {pos} runs past the end"
        assert zlib.crc32(data[pos + RECORD.size : end]) == crc, f"bad record at byte {pos}"
        spans.append((pos, end - pos))
        pos = end
    return spans


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        (byte,) = f.read(1)
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def append_bytes(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


async def until(predicate: Callable[[], bool], timeout: float) -> None:
    """Poll ``predicate`` until it holds; fail after ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        while True:
            if predicate():
                return
            await asyncio.sleep(0.005)


def assert_no_traceback(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr


def arange(n: int, dtype: Any, start: int = 0) -> np.ndarray:
    return (np.arange(n) + start).astype(dtype)


async def refused(data_dir: Path, **kwargs: Any) -> PersistenceError:
    """Start a node on ``data_dir``; answer the PersistenceError it refuses with."""
    node = Node("127.0.0.1", 0, data_dir=data_dir, **kwargs)
    try:
        await node.start()
    except PersistenceError as exc:
        return exc
    await node.stop(grace=1.0)
    raise AssertionError(f"the node started on {data_dir}: {len(node.table)} parameters")


async def write_one_by_one(client: ParameterClient, updates: list[dict[str, Any]]) -> None:
    """One update at a time: each is its own batch, so its own log record."""
    for arrays in updates:
        await client.update_arrays(arrays, replace=True)


# == 1. kill -9 at random moments ============================================================

KILL_ROUNDS = 4
SMALL_ITEMS = 256
BIG_ITEMS = 2 * MIB // 8  # int64: 2 MiB, written to the log from a worker thread
# Writers: each a group of names updated together, one update at a time.
GROUPS: tuple[tuple[str, ...], ...] = (
    ("w0",),
    ("w1",),
    ("w2",),
    ("w3",),
    ("pair_a", "pair_b"),  # always together: a record is all or nothing
    ("big",),
)


def payload(name: str, step: int) -> np.ndarray:
    """The array written to ``name`` at ``step``: [crc of the name, step, step, ...]."""
    arr = np.full(BIG_ITEMS if name == "big" else SMALL_ITEMS, step, dtype=np.int64)
    arr[0] = zlib.crc32(name.encode())
    return arr


class Ledger:
    """What the client knows: acknowledged (version -> step) and unanswered steps, by name."""

    def __init__(self) -> None:
        names = [n for g in GROUPS for n in g]
        self.acked: dict[str, dict[int, int]] = {n: {} for n in names}
        self.unanswered: dict[str, set[int]] = {n: set() for n in names}
        self._steps = dict.fromkeys(GROUPS, 0)

    def next_step(self, group: tuple[str, ...]) -> int:
        self._steps[group] += 1
        return self._steps[group]

    def ack(self, name: str, version: int, step: int) -> None:
        known = self.acked[name].get(version)
        assert known in (None, step), (
            f"{name} v{version} acknowledged as step {step}, but it was step {known} already"
        )
        self.acked[name][version] = step


async def keep_writing(client: ParameterClient, group: tuple[str, ...], ledger: Ledger) -> None:
    """Write the group, one update at a time, until a call fails (the node died)."""
    while True:
        step = ledger.next_step(group)
        try:
            versions = await client.update_arrays({n: payload(n, step) for n in group})
        except (ParamSyncError, OSError):
            for name in group:
                ledger.unanswered[name].add(step)  # may or may not have been applied
            return
        for name, version in versions.items():
            ledger.ack(name, version, step)


async def verify_ledger(client: ParameterClient, ledger: Ledger) -> None:
    """Every acknowledged update survived; whatever is stored is exactly what was sent."""
    got = await read_state(client, list(ledger.acked))
    steps = {}
    for name, acked in ledger.acked.items():
        if name not in got:
            assert not acked, f"{name} lost: acknowledged {acked}"
            continue
        version, _origin, dtype, shape, data = got[name]
        n = BIG_ITEMS if name == "big" else SMALL_ITEMS
        assert (dtype, shape) == ("<i8", (n,)), (name, dtype, shape)
        step = int(np.frombuffer(data, np.int64)[1])
        assert data == payload(name, step).tobytes(), f"{name} v{version}: bytes never sent"
        if acked:
            assert version >= max(acked), (
                f"{name}: stored v{version} < last acknowledged v{max(acked)}"
            )
        if version in acked:
            assert acked[version] == step, f"{name} v{version}: step {step}, not {acked[version]}"
        else:
            assert step in ledger.unanswered[name], f"{name} v{version}: step {step} never sent"
        ledger.ack(name, version, step)  # it is on disk now: it must stay
        steps[name] = step
    if "pair_a" in steps or "pair_b" in steps:
        assert steps.get("pair_a") == steps.get("pair_b"), f"a torn update: {steps}"


@pytest.mark.slow
@pytest.mark.parametrize("fsync", ["always", "batch"])
async def test_kill_9_at_random_moments_loses_no_acknowledged_update(
    spawn: Spawn, tmp_path: Path, fsync: str
) -> None:
    """SIGKILL a node while updates are in flight, restart it, and again; nothing answered is lost.

    With ``--fsync always`` an answered update was fsynced. With ``--fsync
    batch`` it may not have been, but it was written (``writev`` returned) to
    the log before the answer: it is in the operating system's cache, which a
    killed process cannot take with it. So for ``kill -9`` both promise the
    same: every acknowledged update is there after the restart (only a crash
    of the machine tells them apart). Unanswered updates may or may not be
    there, but if one is, it holds exactly the bytes sent; a two-name update
    is there whole or not at all. "big" (2 MiB) takes the worker-thread path.
    """
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    data_dir = tmp_path / "data"
    flags = ("--data-dir", str(data_dir), "--fsync", fsync)
    ledger = Ledger()
    stderr = []
    for round_ in range(KILL_ROUNDS):
        node = await spawn(*flags)
        async with client_of(node.address) as client:
            await verify_ledger(client, ledger)
            writers = [asyncio.create_task(keep_writing(client, g, ledger)) for g in GROUPS]
            await asyncio.sleep(rng.uniform(0.1, 0.5))
            assert not any(w.done() for w in writers), "a writer stopped before the kill"
            await node.kill()
            assert await node.wait_exit(EXIT_TIMEOUT) == -signal.SIGKILL
            async with asyncio.timeout(CALL_TIMEOUT):
                await asyncio.gather(*writers)
        stderr.append(node.stderr)
        # Every writer had a call in flight when the node died.
        for group in GROUPS:
            assert len(ledger.unanswered[group[0]]) == round_ + 1, (seed, group)
    assert all(ledger.acked.values()), f"a name never acknowledged: {ledger.acked}"
    assert sum(map(len, ledger.acked.values())) >= 10 * KILL_ROUNDS, ledger.acked
    # Recover once more, stop cleanly (a snapshot), and recover from that.
    node = await spawn(*flags)
    async with client_of(node.address) as client:
        await verify_ledger(client, ledger)
    assert await terminate(node) == 0, node.stderr
    stderr.append(node.stderr)
    node = await spawn(*flags)
    async with client_of(node.address) as client:
        await verify_ledger(client, ledger)
    assert await terminate(node) == 0, node.stderr
    stderr.append(node.stderr)
    for text in stderr:
        assert_no_traceback(text)
        assert " ERROR " not in text and " CRITICAL " not in text, (seed, text)


# == 2. a clean shutdown writes a snapshot ===================================================


def mixed_parameters() -> list[Any]:
    """Little-endian numeric arrays of every kind, other layouts, and dtype-less bytes."""
    rng = np.random.default_rng(11)
    arrays = {
        "f32": rng.standard_normal((3, 4)).astype(np.float32),
        "f64": rng.standard_normal(7),
        "f16": rng.standard_normal((2, 3, 4)).astype(np.float16),
        "i64": arange(5, np.int64, -2),
        "i32": arange(6, np.int32).reshape(2, 3),
        "i16": arange(4, np.int16),
        "i8": arange(9, np.int8, -4),
        "u64": arange(3, np.uint64),
        "u32": arange(3, np.uint32),
        "u16": arange(3, np.uint16),
        "u8": arange(200, np.uint8),
        "bool": np.array([True, False, True, True]),
        "c64": (rng.standard_normal(3) + 1j * rng.standard_normal(3)).astype(np.complex64),
        "scalar": np.array(3.5, dtype=np.float64),
        "empty": np.zeros((0, 3), np.float32),
        "big_endian": arange(6, ">i4").reshape(3, 2),
        "c128": np.array([1 + 2j, 3 - 4j]),
        "large": rng.standard_normal(MIB // 2).astype(np.float32),  # 2 MiB
    }
    params = [
        thrift.Parameter(name=n, data=a.tobytes(), dtype=a.dtype.str, shape=list(a.shape))
        for n, a in arrays.items()
    ]
    bf16 = rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16)
    params.append(
        thrift.Parameter(name="bf16", data=bf16.tobytes(), dtype="bfloat16", shape=[3, 5])
    )
    params.append(thrift.Parameter(name="raw", data=b"\x00\x01plain bytes\xff"))
    params.append(thrift.Parameter(name="raw_shaped", data=bytes(range(6)), shape=[2, 3]))
    return params


@pytest.mark.slow
async def test_sigterm_writes_a_snapshot_safetensors_reads_and_a_restart_recovers(
    spawn: Spawn, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    params = mixed_parameters()
    names = [p.name for p in params]
    node = await spawn("--data-dir", str(data_dir), "--fsync", "batch")
    async with client_of(node.address) as client:
        await client.update_parameters(params)
        await client.update_parameters([p for p in params if p.name in ("f32", "raw")])
        before = await read_state(client, names)
    assert before["f32"][0] == 2 and before["i8"][0] == 1
    assert await terminate(node) == 0, node.stderr
    assert_no_traceback(node.stderr)

    # One snapshot pair and a small (here: empty) log; older segments are gone. (LOCK
    # stays: a node's flock on it, dropped as it exited, keeps out a second node.)
    [n] = snapshot_numbers(data_dir)
    assert segment_numbers(data_dir) == [n]
    assert sorted(p.name for p in data_dir.iterdir()) == sorted(
        [
            f"snapshot-{n:08d}.json",
            f"snapshot-{n:08d}.safetensors",
            f"wal-{n:08d}.log",
            persistence.LOCK_NAME,
        ]
    )
    assert segment_path(data_dir, n).stat().st_size < 1024

    # safetensors reads it: numeric little-endian arrays as themselves, others as bytes.
    tensors = safetensors.numpy.load_file(str(data_dir / f"snapshot-{n:08d}.safetensors"))
    assert set(tensors) == set(names)
    for name, (_v, _o, dtype, shape, data) in before.items():
        got = tensors[name]
        if dtype is not None and np.dtype(dtype).byteorder in "<=|" and dtype != "<c16":
            expected = np.frombuffer(data, np.dtype(dtype)).reshape(shape)
            assert got.dtype == expected.dtype, name
            assert got.shape == expected.shape, name
            np.testing.assert_array_equal(got, expected, err_msg=name)
        else:
            assert got.dtype == np.uint8 and got.shape == (len(data),), (name, got.dtype)
            assert got.tobytes() == data, name
    # ... and the .json beside it has what safetensors cannot hold.
    meta = json.loads((data_dir / f"snapshot-{n:08d}.json").read_text())
    for name, (version, origin, dtype, shape, data) in before.items():
        p = meta["parameters"][name]
        assert (p["version"], p["origin"], p["dtype"]) == (version, origin, dtype), name
        assert (tuple(p["shape"]) if p["shape"] is not None else None) == shape, name
        assert (p["nbytes"], p["crc32"]) == (len(data), zlib.crc32(data)), name

    node = await spawn("--data-dir", str(data_dir))
    async with client_of(node.address) as client:
        after = await read_state(client, names)
        arrays = await client.get_arrays(["f16", "big_endian", "scalar", "empty"])
    assert after == before
    assert arrays["big_endian"].dtype == np.dtype(">i4") and arrays["big_endian"].shape == (3, 2)
    assert arrays["scalar"].shape == () and arrays["empty"].shape == (0, 3)
    assert tensors["bf16"].dtype == np.dtype(ml_dtypes.bfloat16)  # safetensors' BF16
    assert await terminate(node) == 0, node.stderr
    assert_no_traceback(node.stderr)


# == 3. a snapshot when the log has grown ====================================================


async def test_log_growth_takes_a_snapshot_and_drops_older_segments(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    async with running(data_dir) as node:
        node.data_dir.snapshot_wal_bytes = 16 * 1024
        async with client_of(node.address) as client:
            # ~100 KiB of log in separate records: several snapshots' worth.
            await write_one_by_one(
                client,
                [
                    {f"p{i % 7}": arange(256, np.float32, i), "step": np.array(i)}
                    for i in range(100)
                ],
            )

            def settled() -> bool:
                # The newest snapshot is the current segment's, written whole, older files gone.
                snaps = snapshot_numbers(data_dir)
                return (
                    snaps == [node.data_dir.segment]
                    and segment_numbers(data_dir)[0] == snaps[0]
                    and not list(data_dir.glob("*.tmp"))
                )

            await until(settled, 10)
            [n] = snapshot_numbers(data_dir)
            assert n > 2, "more than one snapshot was due"
            assert segment_numbers(data_dir) == [n]
            node.data_dir.snapshot_wal_bytes = 1 << 30  # no more snapshots from here
            in_log = len(record_spans(segment_path(data_dir, n).read_bytes()))
            # More writes after the snapshot: these are only in the log.
            await write_one_by_one(
                client,
                [
                    {"p0": arange(256, np.float32, 1000 + i), "late": np.ones(i + 1)}
                    for i in range(5)
                ],
            )
        image = crash_image(data_dir, tmp_path / "image")
        live = table_state(node.table)
    recovered, found = recover_into_table(image)
    assert found.snapshot == n and found.records == in_log + 5 and found.torn_bytes == 0
    assert found.parameters == len(live) - 1  # "late" is only in the log
    assert recovered == live
    # After the clean stop: the same again, from its final snapshot.
    assert recover_into_table(data_dir)[0] == live


# == 4. a torn tail is cut =================================================================


async def log_image(tmp_path: Path, updates: int = 6) -> tuple[Path, State]:
    """A crash image with ``updates`` records in its one segment; the state they make."""
    async with running(tmp_path / "live") as node:
        async with client_of(node.address) as client:
            await write_one_by_one(
                client,
                [
                    {f"p{i % 3}": arange(64, np.int32, i), f"q{i}": np.full(3, i, np.float64)}
                    for i in range(updates)
                ],
            )
        image = crash_image(tmp_path / "live", tmp_path / "image")
        state = table_state(node.table)
    assert segment_numbers(image) == [1] and not snapshot_numbers(image)
    assert len(record_spans(segment_path(image, 1).read_bytes())) == updates
    return image, state


def torn(kind: str, segment: bytes) -> bytes:
    """The bytes a torn write of ``kind`` leaves after ``segment``'s records."""
    pos, size = record_spans(segment)[-1]
    record = segment[pos : pos + size]
    if kind == "garbage":
        return b"garbage!" * 3
    if kind == "header_cut":
        return record[:5]
    if kind == "record_cut":
        return record[: size - 7]
    if kind == "bad_crc":
        length, crc = RECORD.unpack_from(record)
        return RECORD.pack(length, crc ^ 1) + record[RECORD.size :]
    if kind == "zeros":  # a file extended but its data never written (a power cut)
        return bytes(64)
    raise AssertionError(kind)


TORN_KINDS = [
    "garbage",
    "header_cut",
    "record_cut",
    "bad_crc",
    "zeros",
]


@pytest.mark.parametrize("kind", TORN_KINDS)
async def test_a_torn_tail_is_cut_with_a_warning_and_the_log_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    image, state = await log_image(tmp_path)
    segment = segment_path(image, 1)
    good = segment.read_bytes()
    tail = torn(kind, good)
    append_bytes(segment, tail)
    caplog.set_level(logging.WARNING, logger="aioparamsync")
    async with running(image) as node:
        assert segment.stat().st_size == len(good)
        assert segment.read_bytes() == good
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(str(segment) in m and f"cutting {len(tail)} bytes" in m for m in warnings), (
            warnings
        )
        assert {k: v[0] for k, v in table_state(node.table).items()} == {
            k: v[0] for k, v in state.items()
        }
        assert table_state(node.table) == state
        # The log goes on after the cut: a new write, then a crash, then recovery.
        async with client_of(node.address) as client:
            assert await client.update_arrays({"p0": np.arange(3.0)}, replace=True) == {
                "p0": state["p0"][0] + 1
            }
        again = crash_image(image, tmp_path / "again")
        expected = table_state(node.table)
    recovered, found = recover_into_table(again)
    assert found.torn_bytes == 0 and recovered == expected
    # ... and after the clean stop, from its snapshot.
    assert recover_into_table(image)[0] == expected


@pytest.mark.slow
async def test_a_node_process_cuts_a_torn_tail_and_says_so(spawn: Spawn, tmp_path: Path) -> None:
    image, state = await log_image(tmp_path)
    segment = segment_path(image, 1)
    size = segment.stat().st_size
    append_bytes(segment, b"\x00\x00\x10")
    node = await spawn("--data-dir", str(image))
    assert segment.stat().st_size == size
    async with client_of(node.address) as client:
        got = await read_state(client, list(state))
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in state.items()}
    assert {k: v[4] for k, v in got.items()} == {k: v[4] for k, v in state.items()}
    assert await terminate(node) == 0
    assert " WARNING " in node.stderr and "cutting 3 bytes" in node.stderr, node.stderr
    assert str(segment) in node.stderr
    assert_no_traceback(node.stderr)


async def test_damage_inside_the_last_segment_before_whole_records_is_refused(
    tmp_path: Path,
) -> None:
    image, _ = await log_image(tmp_path)
    segment = segment_path(image, 1)
    spans = record_spans(segment.read_bytes())
    pos, size = spans[2]  # three whole records follow it
    flip_byte(segment, pos + RECORD.size + size // 2)
    before = segment.read_bytes()
    message = str(await refused(image))
    assert "records follow it" in message and segment.name in message
    assert segment.read_bytes() == before  # nothing cut


# == 5. damage that is not a torn tail =====================================================


def split_segment(image: Path, at: int) -> None:
    """Make segment 1's records 0..at-1 segment 1, and the rest segment 2."""
    data = segment_path(image, 1).read_bytes()
    pos, _ = record_spans(data)[at]
    segment_path(image, 1).write_bytes(data[:pos])
    segment_path(image, 2).write_bytes(data[pos:])


async def test_a_damaged_record_before_another_segment_is_refused(tmp_path: Path) -> None:
    image, state = await log_image(tmp_path)
    split_segment(image, 3)
    assert recover_into_table(crash_image(image, tmp_path / "intact"))[0] == state
    first = segment_path(image, 1)
    pos, size = record_spans(first.read_bytes())[1]
    flip_byte(first, pos + RECORD.size + size // 2)
    damaged = first.read_bytes()
    for ignore in (False, True):  # the flag is about snapshots, not the log
        message = str(await refused(image, ignore_corrupt_snapshot=ignore))
        assert str(first) in message and "damaged" in message, message
    assert first.read_bytes() == damaged, "nothing is cut"
    result = run_cli("--data-dir", str(image))
    assert result.returncode == 1, result
    assert str(first) in result.stderr and "damaged" in result.stderr, result.stderr
    assert_no_traceback(result.stderr)
    assert result.stdout == ""


async def snapshot_then_log_image(tmp_path: Path) -> tuple[Path, int, State, State]:
    """A snapshot of a, b, c, then a log of a (newer) and d; answer the crash image,
    the snapshot's number, the whole state, and the part the log alone holds."""
    live = tmp_path / "live"
    async with running(live) as node, client_of(node.address) as client:
        await client.update_arrays({"a": np.arange(4.0), "b": arange(5, np.int32)})
        await client.update_arrays({"c": np.ones((2, 2), np.float32)})
    [n] = snapshot_numbers(live)
    async with running(live) as node:
        async with client_of(node.address) as client:
            await client.update_arrays({"a": np.arange(4.0) * 2})
            await client.update_arrays({"d": arange(3, np.int64)})
        image = crash_image(live, tmp_path / "image")
        state = table_state(node.table)
    assert snapshot_numbers(image) == [n] and segment_numbers(image) == [n]
    return image, n, state, {k: state[k] for k in ("a", "d")}


def corrupt_snapshot(image: Path, n: int, how: str) -> None:
    data = image / f"snapshot-{n:08d}.safetensors"
    meta = image / f"snapshot-{n:08d}.json"
    if how == "flipped_data_byte":
        (header_len,) = struct.unpack_from("<Q", data.read_bytes())
        flip_byte(data, 8 + header_len + 3)
    elif how == "truncated_data":
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size - 10)
    elif how == "truncated_header":
        with open(data, "r+b") as f:
            f.truncate(5)
    elif how == "garbage_json":
        meta.write_text('{"format": 1, "timestamp": 12, "parameters": {"a": ')
    elif how == "json_of_another_shape":
        meta.write_text('{"format": 1, "timestamp": 12, "parameters": {"a": {"version": 1}}}')
    else:
        raise AssertionError(how)


SNAPSHOT_DAMAGE = [
    "flipped_data_byte",
    "truncated_data",
    "truncated_header",
    "garbage_json",
    "json_of_another_shape",
]


# With --ignore-corrupt-snapshot, what each damage leaves of the snapshot of a, b, c (in that
# order in its file): a damaged parameter is dropped alone; damage to what describes the
# file leaves nothing of it. The log holds a newer a, and d.
SALVAGED = {
    "flipped_data_byte": {"b", "c"},  # (a byte of a's data: the log has a newer a)
    "truncated_data": {"a", "b"},  # (c ran past the end)
    "truncated_header": set(),
    "garbage_json": set(),
    "json_of_another_shape": set(),
}


@pytest.mark.parametrize("how", SNAPSHOT_DAMAGE)
async def test_a_corrupt_snapshot_is_refused_unless_ignored(tmp_path: Path, how: str) -> None:
    image, n, state, log_only = await snapshot_then_log_image(tmp_path)
    corrupt_snapshot(image, n, how)
    message = str(await refused(image))
    assert f"snapshot-{n:08d}" in message and "--ignore-corrupt-snapshot" in message, message
    # With the flag: what passes its checks, and the log over it (what only the damaged
    # parameters held in the snapshot is lost, as documented); the damaged files kept aside.
    kept = {k: v for k, v in state.items() if k in SALVAGED[how] or k in log_only}
    async with running(image, ignore_corrupt_snapshot=True) as node:
        assert table_state(node.table) == kept
    aside = sorted(p.name for p in image.iterdir() if ".corrupt-" in p.name)
    assert [re.sub(r"\.corrupt-.*", "", name) for name in aside] == [
        f"snapshot-{n:08d}.json",
        f"snapshot-{n:08d}.safetensors",
    ], aside
    # What was recovered is a snapshot of its own: the next start needs no flag.
    async with running(image) as node:
        assert table_state(node.table) == kept


@pytest.mark.slow
async def test_the_cli_refuses_a_corrupt_snapshot_unless_told_to_ignore_it(
    spawn: Spawn, tmp_path: Path
) -> None:
    image, n, state, _log_only = await snapshot_then_log_image(tmp_path)
    corrupt_snapshot(image, n, "flipped_data_byte")
    result = run_cli("--data-dir", str(image))
    assert result.returncode == 1, result
    assert result.stderr.startswith("aioparamsync-node: ") or "\naioparamsync-node: " in (
        result.stderr
    ), result.stderr
    assert f"snapshot-{n:08d}.safetensors" in result.stderr, result.stderr
    assert "checksum" in result.stderr and "--ignore-corrupt-snapshot" in result.stderr
    assert_no_traceback(result.stderr)
    node = await spawn("--data-dir", str(image), "--ignore-corrupt-snapshot")
    async with client_of(node.address) as client:
        got = await read_state(client, ["a", "b", "c", "d"])
    # (a's data was damaged: dropped, and the log's newer a replayed; b and c kept)
    assert got == state
    assert await terminate(node) == 0
    assert_no_traceback(node.stderr)


# == 6. bad data directories ===============================================================


def unwritable_dir(tmp_path: Path) -> Path:
    """A data directory this process cannot write to.

    Permission bits do not stop root (the tests may run as root): then a path
    under a regular file, which no one can make a directory of.
    """
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if not os.access(locked, os.W_OK):
        return locked
    (tmp_path / "a_file").write_text("not a directory\n")
    return tmp_path / "a_file" / "data"


def test_the_cli_refuses_a_data_dir_that_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("hello\n")
    result = run_cli("--data-dir", str(path))
    assert result.returncode == 1, result
    assert result.stderr.startswith("aioparamsync-node: "), result.stderr
    assert str(path) in result.stderr and "data directory" in result.stderr, result.stderr
    assert_no_traceback(result.stderr)
    assert path.read_text() == "hello\n"


def test_the_cli_refuses_a_data_dir_it_cannot_write(tmp_path: Path) -> None:
    path = unwritable_dir(tmp_path)
    try:
        result = run_cli("--data-dir", str(path))
    finally:
        (tmp_path / "locked").chmod(0o700)
    assert result.returncode == 1, result
    assert result.stderr.startswith("aioparamsync-node: "), result.stderr
    assert str(path) in result.stderr, result.stderr
    assert "cannot listen" not in result.stderr
    assert_no_traceback(result.stderr)


async def test_a_node_refuses_bad_data_dirs_with_persistence_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    for path in (tmp_path / "file", unwritable_dir(tmp_path)):
        assert str(path) in str(await refused(path))
    (tmp_path / "locked").chmod(0o700)


def test_an_unreadable_segment_is_reported_as_a_data_dir_problem(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "wal-00000001.log").mkdir()  # cannot be read as a file, even by root
    result = run_cli("--data-dir", str(data))
    assert result.returncode == 1, result
    assert "wal-00000001.log" in result.stderr, result.stderr
    assert_no_traceback(result.stderr)
    assert "cannot listen" not in result.stderr, result.stderr


# == 7. replicated updates are logged ======================================================


async def test_replicated_updates_are_logged_and_recovered_without_peers(tmp_path: Path) -> None:
    a = Node("127.0.0.1", 0, repair_interval=0.2)
    await a.start()
    b = Node(
        "127.0.0.1",
        0,
        data_dir=tmp_path / "b",
        fsync="always",
        repair_interval=0.2,
        peers=[a.address],
    )
    try:
        await b.start()
        async with client_of(a.address) as client:
            await client.update_arrays({"x": np.arange(6.0).reshape(2, 3), "y": arange(4, np.int8)})
            await client.update_arrays({"x": np.zeros((2, 3))})
            await client.update_parameters([thrift.Parameter(name="raw", data=b"abc")])
        expected = table_state(a.table)
        assert expected["x"][0] == 2 and all(v[1].startswith(a.node_id) for v in expected.values())
        await until(lambda: table_state(b.table) == expected, 15)
        image = crash_image(tmp_path / "b", tmp_path / "image")
    finally:
        await b.stop(grace=1.0)
        await a.stop(grace=1.0)
    # Alone (no peers: nothing to repair from), from the log only, and from the snapshot.
    for path in (image, tmp_path / "b"):
        async with running(path) as b2:
            assert not b2.cluster.links
            assert table_state(b2.table) == expected


# == 8. the log cannot be written ==========================================================


@contextlib.contextmanager
def failing_log(how: str, data_dir: DataDir, monkeypatch: pytest.MonkeyPatch):
    """Make writes to ``data_dir``'s log fail, as the OS would."""
    fd = data_dir._fd
    assert fd is not None
    if how == "enospc":
        real = os.writev

        def writev(target: int, buffers: Any) -> int:
            if target == fd:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(target, buffers)

        monkeypatch.setattr(os, "writev", writev)
        try:
            yield
        finally:
            monkeypatch.setattr(os, "writev", real)
    else:  # the log's descriptor, now read-only: EBADF from the real writev
        read_only = os.open(data_dir.path / f"wal-{data_dir.segment:08d}.log", os.O_RDONLY)
        saved = os.dup(fd)
        os.dup2(read_only, fd)
        os.close(read_only)
        try:
            yield
        finally:
            os.dup2(saved, fd)
            os.close(saved)


@pytest.mark.parametrize("how", ["enospc", "read_only_fd"])
async def test_a_log_write_failure_refuses_updates_and_loses_nothing_acknowledged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    path = tmp_path / "data"
    async with running(path) as node, client_of(node.address) as client:
        await client.update_arrays({"a": np.arange(3.0), "b": arange(4, np.int32)})
        await client.update_arrays({"a": np.arange(3.0) + 1})
        acknowledged = table_state(node.table)
        with failing_log(how, node.data_dir, monkeypatch), pytest.raises(RequestError) as caught:
            await client.update_arrays({"a": np.full(3, 9.0), "c": np.ones(2)})
        assert caught.value.code == ErrorCode.UNAVAILABLE
        assert "could not be logged" in caught.value.message
        assert any(r.levelno == logging.CRITICAL for r in caplog.records)
        # Even with the log writable again, no more updates until a restart.
        for update in ({"b": np.zeros(4, np.int32)}, {"new": np.ones(1)}):
            with pytest.raises(RequestError) as caught:
                await client.update_arrays(update)
            assert caught.value.code == ErrorCode.UNAVAILABLE
            assert "cannot write its log" in caught.value.message
            assert "restart" in caught.value.message
        # Reads still work.
        got = await read_state(client, ["b"])
        assert got == {"b": acknowledged["b"]}
    recovered, _ = recover_into_table(path)
    assert recovered == acknowledged
    async with running(path) as node:
        assert table_state(node.table) == acknowledged
        async with client_of(node.address) as client:
            assert await client.update_arrays({"a": np.zeros(3)}) == {"a": 3}


async def test_an_update_queued_behind_a_failed_log_write_is_not_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "data"
    async with running(path) as node, client_of(node.address) as client:
        await client.update_arrays({"a": np.arange(3.0)})
        fd = node.data_dir._fd
        go, entered = threading.Event(), threading.Event()
        real_writev, real_write = os.writev, os.write
        failures = []

        def writev(target: int, buffers: Any) -> int:
            if target != fd or failures:
                return real_writev(target, buffers)
            entered.set()
            go.wait(10)  # until the next update waits in the store's queue
            data = b"".join(bytes(b) for b in buffers)
            return real_write(target, data[: len(data) // 2])  # a short write: the disk is full

        def write(target: int, data: Any) -> int:
            if target == fd and not failures:
                failures.append(len(data))
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_write(target, data)

        monkeypatch.setattr(os, "writev", writev)
        monkeypatch.setattr(os, "write", write)
        big = asyncio.ensure_future(client.update_arrays({"big": np.ones(MIB // 2, np.float32)}))
        await until(entered.is_set, 10)  # the big update is being written, in a worker thread
        small = asyncio.ensure_future(client.update_arrays({"small": np.ones(2)}))
        await until(lambda: node.store.statistics()["pending"] > 0, 10)  # queued behind it
        go.set()
        with pytest.raises(RequestError):
            await big
        try:
            acknowledged = await small
        except RequestError as exc:
            acknowledged = None  # refused, as the docs say: nothing to lose
            assert exc.code == ErrorCode.UNAVAILABLE
        monkeypatch.setattr(os, "writev", real_writev)
        monkeypatch.setattr(os, "write", real_write)
    state, found = recover_into_table(path)
    if acknowledged is not None:
        assert "small" in state, f"acknowledged {acknowledged}, lost ({found})"
    assert acknowledged is None, "an update was accepted after the log failed"


# == fsync batch: the promise of FSYNC_BATCH_SECONDS ========================================


async def test_fsync_batch_syncs_an_acknowledged_update_within_the_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    interval = 0.2
    monkeypatch.setattr(persistence, "FSYNC_BATCH_SECONDS", interval)
    real_fsync, real_writev = os.fsync, os.writev
    synced: list[tuple[int, float]] = []
    written: list[tuple[int, float]] = []

    def fsync(fd: int) -> None:
        real_fsync(fd)
        synced.append((fd, time.monotonic()))

    def writev(fd: int, buffers: Any) -> int:
        written.append((fd, time.monotonic()))
        return real_writev(fd, buffers)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "writev", writev)
    async with running(tmp_path / "data", fsync="batch") as node:
        log_fd = node.data_dir._fd
        async with client_of(node.address) as client:
            await client.update_arrays({"a": np.ones(2)})  # the first is synced at once
            await client.update_arrays({"a": np.zeros(2)})  # well within the interval
            await asyncio.sleep(interval * 5)
        last_write = max(t for fd, t in written if fd == log_fd)
        assert any(fd == log_fd and t > last_write for fd, t in synced), (
            f"the log was written, then not synced for {time.monotonic() - last_write:.1f} s "
            f"(FSYNC_BATCH_SECONDS = {interval})"
        )


# == 9. one node a directory =================================================================


def logged_table(path: Path, updates: int = 3) -> tuple[DataDir, ParameterTable]:
    """A recovered DataDir on ``path`` (left open) with ``updates`` updates logged and synced."""
    table = ParameterTable("first")
    data_dir = DataDir(path, fsync="always")
    data_dir.recover(table)
    for i in range(updates):
        applied = table.apply([thrift.Parameter(name=f"p{i}", data=bytes([i]) * 8)], i + 1)
        data_dir.append(applied.entries, table.timestamp)
    data_dir.sync()
    return data_dir, table


def test_a_second_data_dir_on_a_directory_in_use_is_refused_until_the_first_closes(
    tmp_path: Path,
) -> None:
    """Two nodes on one directory would delete each other's log as they snapshot: the
    second is refused, touching no file, and may try again once the first has closed.
    (A flock belongs to an open file: two DataDirs of one process exclude each other.)"""
    path = tmp_path / "data"
    first, table = logged_table(path)
    try:
        before = {p.name: p.read_bytes() for p in path.iterdir()}
        second = DataDir(path)
        second_table = ParameterTable("second")
        for _ in range(2):  # refused again: a refusal holds nothing
            with pytest.raises(PersistenceError) as caught:
                second.recover(second_table)
            message = str(caught.value)
            assert f"data directory {path} is in use by another node" in message, message
            assert f"(pid {os.getpid()})" in message, message
        assert len(second_table) == 0
        assert {p.name: p.read_bytes() for p in path.iterdir()} == before
        # The first goes on: a record, a snapshot (which drops older segments).
        applied = table.apply([thrift.Parameter(name="late", data=b"late")], 10)
        first.append(applied.entries, table.timestamp)
        n = first.start_snapshot()
        first.write_snapshot(n, [e for name in table.names() if (e := table.entry(name))], 10)
    finally:
        first.close()
    # Closed: released, to the DataDir refused before as to any other.
    try:
        second.recover(second_table)
    finally:
        second.close()
    assert table_state(second_table) == table_state(table)
    assert recover_into_table(path)[0] == table_state(table)


async def test_a_node_refused_a_data_dir_in_use_holds_nothing(tmp_path: Path) -> None:
    path = tmp_path / "data"
    holder, table = logged_table(path)
    try:
        message = str(await refused(path))
        assert f"{path} is in use by another node (pid {os.getpid()})" in message, message
    finally:
        holder.close()
    async with running(path) as node:
        assert table_state(node.table) == table_state(table)


async def test_a_node_process_refuses_a_data_dir_another_node_process_holds(
    spawn: Spawn, tmp_path: Path
) -> None:
    """The second node exits 1 with one line saying who holds the directory; the first
    goes on, and once it is gone (even by ``kill -9``: the kernel drops the lock) the
    directory is free again, with everything the first acknowledged."""
    data_dir = tmp_path / "data"
    flags = ("--data-dir", str(data_dir), "--fsync", "always")
    first = await spawn(*flags)
    async with client_of(first.address) as client:
        assert await client.update_arrays({"a": np.arange(3.0)}) == {"a": 1}
        result = await asyncio.to_thread(run_cli, *flags)
        assert result.returncode == 1, result
        assert result.stdout == ""
        assert result.stderr.splitlines() == [
            f"aioparamsync-node: data directory {data_dir} is in use by another node "
            f"(pid {first.pid}); the node will not start (two nodes on one directory "
            "delete each other's log)"
        ], result.stderr
        assert await client.update_arrays({"a": np.arange(3.0) + 1}) == {"a": 2}
        expected = await read_state(client, ["a"])
    assert await first.kill() == -signal.SIGKILL
    second = await spawn(*flags)
    async with client_of(second.address) as client:
        assert await read_state(client, ["a"]) == expected
    assert await terminate(second) == 0, second.stderr
    assert_no_traceback(first.stderr + second.stderr)


# == 10. large parameters with long names in the log =========================================

# 1015 bytes: within the names a node takes (Limits.max_name_bytes, 1024).
LONG_NAME = "encoder." + "x" * 1000 + ".weight"


async def test_a_large_parameter_with_a_long_name_is_logged_in_pieces_and_recovered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parameter larger than ``pieces.INLINE_BYTES`` is logged in pieces under one upload
    id; a long name and node id must not make that id longer than replay takes, or the
    node answers the update and then cannot start. Sizes scaled down: 4 KiB inline,
    pieces of 1 KiB (really 128 and 64 MiB)."""
    monkeypatch.setattr(pieces, "INLINE_BYTES", 4 * 1024)
    monkeypatch.setattr(pieces, "PIECE_BYTES", 1024)
    path = tmp_path / "data"
    big = arange(4096, np.float32)  # 16 KiB: 16 pieces
    async with running(path, node_id="node-" + "n" * 250) as node:
        async with client_of(node.address) as client:
            assert await client.update_arrays({LONG_NAME: big, "small": np.ones(2)}) == {
                LONG_NAME: 1,
                "small": 1,
            }
        image = crash_image(path, tmp_path / "image")
        expected = table_state(node.table)
    assert len(record_spans(segment_path(image, 1).read_bytes())) == 1 + 16  # "small", pieces
    recovered, found = recover_into_table(image)
    assert recovered == expected and found.records == 1 + 16
    assert recover_into_table(path)[0] == expected  # and from the clean stop's snapshot


def test_a_log_with_the_upload_ids_of_older_versions_replays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Versions before upload ids in the log were hashed wrote ``log:origin:version:name``:
    such a log still replays, whether the id was short enough for replay (it was then)
    or not (acknowledged, but refused on replay then)."""
    monkeypatch.setattr(pieces, "INLINE_BYTES", 1024)
    monkeypatch.setattr(pieces, "PIECE_BYTES", 256)
    path = tmp_path / "data"
    data_dir, table = logged_table(path, updates=0)
    try:
        for i, name in enumerate(["short", LONG_NAME, "short"]):
            data = arange(1024, np.int32, i)
            param = thrift.Parameter(name=name, data=data.tobytes(), dtype="<i4", shape=[1024])
            [entry] = table.apply([param], i + 1).entries
            old_id = f"log:{entry.origin}:{entry.version}:{entry.name}"  # as they wrote it
            assert (len(old_id.encode()) > 256) == (name == LONG_NAME)
            for piece in pieces.split(entry.to_parameter(), old_id, pieces.PIECE_BYTES):
                data_dir._write_record(thrift.ParameterUpdate(params=[piece], timestamp=i + 1))
    finally:
        data_dir.close()
    recovered, found = recover_into_table(path)
    assert found.records == 3 * 16
    assert recovered == table_state(table)
    assert recovered["short"][0] == 2 and recovered[LONG_NAME][0] == 1


# == 10b. what one batch holds ==============================================================


async def test_a_batch_that_updated_a_name_twice_survives_a_crash(tmp_path: Path) -> None:
    """The writer applies the updates queued at once as one batch, logged together:
    two workers updating one name put it in a batch twice. Replayed as one update,
    it was refused ("appears twice") and the node would not start."""
    path = tmp_path / "data"
    async with running(path, fsync="batch") as node:
        async with client_of(node.address) as client:
            updates = [client.update_arrays({"w": np.full(4, i, np.float32)}) for i in range(50)]
            await asyncio.gather(*updates)
        assert node.store.batches < 50  # so some batch held "w" more than once
        image = crash_image(path, tmp_path / "image")
        expected = table_state(node.table)
    recovered, _ = recover_into_table(image)
    assert recovered == expected and recovered["w"][0] == 50


def test_a_record_of_older_versions_with_a_name_twice_replays(tmp_path: Path) -> None:
    """Logs written before batches were written a name once hold such records."""
    path = tmp_path / "data"
    data_dir, table = logged_table(path, updates=0)
    try:
        entries = [
            *table.apply([thrift.Parameter(name="w", data=b"first!")], 1).entries,
            *table.apply([thrift.Parameter(name="w", data=b"second")], 2).entries,
        ]
        params = [e.to_parameter() for e in entries]
        data_dir._write_record(thrift.ParameterUpdate(params=params, timestamp=2))
    finally:
        data_dir.close()
    recovered, _ = recover_into_table(path)
    assert recovered == table_state(table) and recovered["w"][4] == b"second"


@pytest.mark.parametrize("cut", ["before_its_last_record", "amid_its_pieces"])
def test_a_crash_amid_a_batch_with_a_large_parameter_leaves_none_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: str
) -> None:
    """A large parameter is logged in pieces, then its batch's record: a crash before
    that record leaves none of the batch, not its small parameters without the large
    one (the update was not acknowledged; an update is applied whole or not at all).
    Sizes scaled down: 1 KiB inline, pieces of 256 bytes."""
    monkeypatch.setattr(pieces, "INLINE_BYTES", 1024)
    monkeypatch.setattr(pieces, "PIECE_BYTES", 256)
    path = tmp_path / "data"
    data_dir, table = logged_table(path, updates=0)
    try:
        first = table.apply([thrift.Parameter(name="s", data=b"before")], 1)
        data_dir.append(first.entries, table.timestamp)
        before = table_state(table)
        big = arange(1024, np.int32)  # 4 KiB: 16 pieces
        batch = table.apply(
            [
                thrift.Parameter(name="s", data=b"after!"),
                thrift.Parameter(name="b", data=big.tobytes(), dtype="<i4", shape=[1024]),
            ],
            2,
        )
        data_dir.append(batch.entries, table.timestamp)
        after = table_state(table)
    finally:
        data_dir.close()
    log = segment_path(path, 1).read_bytes()
    spans = record_spans(log)
    assert len(spans) == 1 + 16 + 1  # the first batch; b's pieces; the second batch's record
    image = tmp_path / "image"
    image.mkdir()
    keep = spans[-1][0] if cut == "before_its_last_record" else spans[9][0]
    segment_path(image, 1).write_bytes(log[:keep])  # what a crash there leaves
    assert recover_into_table(image)[0] == before
    assert recover_into_table(path)[0] == after  # whole, it replays whole


# == 11. what a crash amid a snapshot leaves =================================================


def snapshot_name(n: int, suffix: str) -> str:
    return f"snapshot-{n:08d}{suffix}"


@contextlib.contextmanager
def snapshot_dies(how: str, monkeypatch: pytest.MonkeyPatch):
    """Make the next snapshot stop where ``how`` says, as a ``kill -9`` there would."""
    real_replace, real_unlink = os.replace, Path.unlink

    def replace(src: Any, dst: Any) -> None:
        name = Path(src).name
        if (how == "data_written" and name.endswith(".safetensors.tmp")) or (
            how == "data_renamed" and name.endswith(".json.tmp")
        ):
            raise OSError(errno.EIO, f"killed before renaming {name}")
        real_replace(src, dst)

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if how == "older_dropped" and self.name.endswith(".safetensors"):
            raise OSError(errno.EIO, f"killed before unlinking {self.name}")
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(Path, "unlink", unlink)
    try:
        yield
    finally:
        monkeypatch.setattr(os, "replace", real_replace)
        monkeypatch.setattr(Path, "unlink", real_unlink)


# How the snapshot died -> (what it left that no recovery reads, the snapshot recovery loads).
SNAPSHOT_DEATHS = {
    # Amid writing its data (the whole file, here: it is never read either way).
    "data_written": ([snapshot_name(3, ".safetensors.tmp")], 2),
    # Between its two renames: data in place, its description not yet.
    "data_renamed": ([snapshot_name(3, ".safetensors"), snapshot_name(3, ".json.tmp")], 2),
    # Written, then dropping the one before it: its description gone, its data not yet.
    "older_dropped": ([snapshot_name(2, ".safetensors")], 3),
}


@pytest.mark.parametrize("how", list(SNAPSHOT_DEATHS))
def test_recovery_removes_what_a_crash_amid_a_snapshot_left_and_keeps_what_it_needs(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    how: str,
) -> None:
    """A crash amid a snapshot leaves files a model's size that no recovery reads; before,
    each crash leaked one for good. Recovery removes them, and nothing else: not the
    snapshot it loads, nor the log it replays."""
    leftovers, loaded = SNAPSHOT_DEATHS[how]
    live = tmp_path / "live"
    data_dir, table = logged_table(live)

    def snapshot() -> None:
        n = data_dir.start_snapshot()
        entries = [e for name in table.names() if (e := table.entry(name))]
        data_dir.write_snapshot(n, entries, table.timestamp)

    def update(name: str, step: int) -> None:
        param = thrift.Parameter(name=name, data=arange(64, np.int16, step).tobytes())
        data_dir.append(table.apply([param], step).entries, table.timestamp)

    try:
        snapshot()  # snapshot 2, whole
        update("p0", 10)  # in segment 2
        with snapshot_dies(how, monkeypatch), pytest.raises(OSError, match="killed"):
            snapshot()  # snapshot 3
        update("p1", 11)  # in segment 3
        data_dir.sync()
        image = crash_image(live, tmp_path / "image")
        expected = table_state(table)
    finally:
        data_dir.close()
    before = {p.name: p.read_bytes() for p in image.iterdir()}
    assert set(leftovers) <= set(before), sorted(before)
    caplog.set_level(logging.WARNING, logger="aioparamsync")
    recovered, found = recover_into_table(image)
    assert recovered == expected and found.snapshot == loaded
    after = {p.name: p.read_bytes() for p in image.iterdir()}
    assert sorted(after) == sorted(set(before) - set(leftovers))
    for name, data in after.items():
        if name != persistence.LOCK_NAME:
            assert data == before[name], f"{name} changed"
    assert {snapshot_name(loaded, ".json"), snapshot_name(loaded, ".safetensors")} <= set(after)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for name in leftovers:
        assert any(f"removing {image / name}" in m for m in warnings), warnings
    # Nothing recovery needs was removed: again, from what is left, the same.
    assert recover_into_table(image)[0] == expected


# == 12. the log's fd between threads ============================================================


def test_a_sync_in_a_worker_thread_and_a_snapshot_cut_do_not_race(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With fsync=batch the log is synced in a worker thread while the event loop's
    thread may cut it for a snapshot (closing its fd): the cut waits for the sync. It
    synced a closed fd (EBADF: the node took no more updates) or, the fd's number
    reused by the next segment, the wrong file (the cut one's tail left unsynced)."""
    data_dir, table = logged_table(tmp_path / "data", updates=1)
    try:
        applied = table.apply([thrift.Parameter(name="late", data=b"late")], 10)
        data_dir.append(applied.entries, table.timestamp)  # dirty: the sync has work
        in_sync, go_on = threading.Event(), threading.Event()
        real_fsync = os.fsync
        synced: list[int] = []  # the inodes the syncer's fsync reached

        def slow_fsync(fd: int) -> None:
            if threading.current_thread().name == "syncer":
                in_sync.set()
                go_on.wait(5)  # the fd is in hand: the cut comes now
                synced.append(os.fstat(fd).st_ino)
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", slow_fsync)
        errors: list[BaseException] = []

        def run(target: Callable[[], Any]) -> Callable[[], None]:
            def guarded() -> None:
                try:
                    target()
                except BaseException as exc:  # noqa: BLE001 (to be asserted on)
                    errors.append(exc)

            return guarded

        syncer = threading.Thread(target=run(data_dir.sync), name="syncer")
        syncer.start()
        assert in_sync.wait(5)
        cut = threading.Thread(target=run(data_dir.start_snapshot), name="cut")
        cut.start()
        cut.join(0.3)
        go_on.set()
        syncer.join(5)
        cut.join(5)
        assert not syncer.is_alive() and not cut.is_alive()
        assert errors == []
        assert data_dir.segment == 2
        # It synced the segment it meant to (not, its fd number reused, the next).
        assert synced == [(tmp_path / "data" / "wal-00000001.log").stat().st_ino]
    finally:
        data_dir.close()
