"""Damaged files, started with ``--ignore-corrupt-snapshot`` or ``--ignore-corrupt-log``:
what is intact is kept, what is damaged kept aside.

Real files and real node processes (``python -m aioparamsync`` on 127.0.0.1,
killed by PID at teardown): a node writes a snapshot of a small parameter
``w`` and a large one, ``big``, stored as partitions; one byte of one
partition's data is flipped in the file. Without the flag the node refuses
to start, naming the file and the flag; with it, ``w`` is back, ``big`` is
dropped (or brought back by the log, or by a replica's repair), and the
damaged files are kept aside. Then a log damaged before other records.
"""

from __future__ import annotations

import json
import shutil
import signal
import struct
from pathlib import Path

import numpy as np
import pytest
from cluster_helpers import (
    NodeProcess,
    Spawn,
    eventually,
    wait_formed,
)
from test_durability import (
    RECORD,
    flip_byte,
    log_image,
    record_spans,
    recover_into_table,
    refused,
    run_cli,
    running,
    segment_path,
    split_segment,
    table_state,
)

from aioparamsync import Node, ParameterClient, thrift
from aioparamsync.persistence.datadir import DataDir
from aioparamsync.placement import manifest_key, partition_key
from aioparamsync.store.table import ParameterTable

pytestmark = pytest.mark.timeout(90)

PB = 4096  # --partition-bytes: 1024 float32 a partition
BIG = np.arange(3000, dtype=np.float32)  # three partitions
W_VERSION = 501
EXIT_TIMEOUT = 15.0


def big_keys() -> set[str]:
    return {manifest_key("big"), *(partition_key("big", i) for i in range(3))}


def snapshot_files(path: Path) -> list[Path]:
    return sorted(path.glob("snapshot-*.safetensors"))


def aside(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if ".corrupt-" in p.name)


def flip_partition_byte(path: Path, index: int = 1) -> Path:
    """Flip a byte in the middle of ``big``'s partition ``index`` in the newest snapshot."""
    [data] = snapshot_files(path)[-1:]
    raw = data.read_bytes()
    (header_len,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8 : 8 + header_len])
    start, end = header[partition_key("big", index)]["data_offsets"]
    at = 8 + header_len + (start + end) // 2
    with open(data, "r+b") as f:
        f.seek(at)
        f.write(bytes([raw[at] ^ 0x5A]))
    return data


async def write_w_and_big(client: ParameterClient) -> None:
    await client.update_parameters(
        [thrift.Parameter(name="w", data=np.ones(4, np.float32).tobytes(), version=W_VERSION)]
    )
    await client.update_arrays({"big": BIG})


async def stop(node: NodeProcess) -> None:
    node.proc.send_signal(signal.SIGTERM)
    assert await node.wait_exit(EXIT_TIMEOUT) == 0, node.stderr


async def test_a_flipped_byte_in_a_partition_drops_that_parameter_alone(
    spawn: Spawn, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    flags = ("--data-dir", str(data_dir), "--partition-bytes", str(PB))
    node = await spawn(*flags)
    async with node.client() as client:
        await write_w_and_big(client)
    await stop(node)
    damaged = flip_partition_byte(data_dir)
    before = sorted(p.name for p in data_dir.iterdir())

    # Without the flag: refused, naming the file, the damage and the flag; nothing changed.
    result = run_cli(*flags)
    assert result.returncode == 1, result
    assert str(damaged) in result.stderr and "big[partition 1]" in result.stderr, result.stderr
    assert "checksum" in result.stderr and "--ignore-corrupt-snapshot" in result.stderr
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in data_dir.iterdir()) == before

    # With it: w is back at its version, big is gone, the damaged files are kept aside.
    node = await spawn(*flags, "--ignore-corrupt-snapshot")
    await node.wait_stderr("dropped")
    async with node.client() as client:
        got = await client.get_parameters(["w", "big"])
        assert [(p.name, p.version) for p in got.params] == [("w", W_VERSION)]
        assert bytes(got.params[0].data) == np.ones(4, np.float32).tobytes()
    stderr = node.stderr
    assert " WARNING " in stderr and "'big'" in stderr and "1 parameter dropped" in stderr, stderr
    kept = aside(data_dir)
    assert [name.split(".corrupt-")[0] for name in kept] == [
        damaged.with_suffix(".json").name,
        damaged.name,
    ], kept
    assert all(name in stderr for name in kept), stderr
    await stop(node)
    # The next snapshots leave them where they are; w is still there without the flag.
    node = await spawn(*flags)
    async with node.client() as client:
        got = await client.get_parameters(["w"])
        assert [(p.name, p.version) for p in got.params] == [("w", W_VERSION)]
    await stop(node)
    assert aside(data_dir) == kept


async def test_the_log_brings_back_what_it_holds_of_a_dropped_parameter(tmp_path: Path) -> None:
    live = tmp_path / "live"
    async with (
        Node("127.0.0.1", 0, data_dir=live, partition_bytes=PB, fsync="always") as node,
        ParameterClient(node.address, timeout=10) as client,
    ):
        await write_w_and_big(client)
    # A snapshot holds w and big; the log after it holds a newer big.
    async with Node("127.0.0.1", 0, data_dir=live, partition_bytes=PB, fsync="always") as node:
        async with ParameterClient(node.address, timeout=10) as client:
            await client.update_arrays({"big": BIG * 2})
        image = tmp_path / "image"
        shutil.copytree(live, image)  # (what a kill -9 now would leave)
    flip_partition_byte(image, index=2)
    table = ParameterTable("recovery")
    data_dir = DataDir(image, ignore_corrupt_snapshot=True)
    try:
        found = data_dir.recover(table)
    finally:
        data_dir.close()
    assert list(found.dropped) == ["big"] and "partition 2" in found.dropped["big"]
    assert len(found.set_aside) == 2 and all(p.exists() for p in found.set_aside)
    assert table.entry("w").version == W_VERSION
    assert big_keys() <= set(table.names())
    parts = [np.frombuffer(table.entry(partition_key("big", i)).data, np.float32) for i in range(3)]
    assert np.array_equal(np.concatenate(parts), BIG * 2)


async def test_a_replica_brings_back_a_dropped_parameter(spawn: Spawn, tmp_path: Path) -> None:
    cluster = (
        "--partition-bytes",
        str(PB),
        "--replication-factor",
        "2",
        "--repair-interval",
        "0.2",
    )
    b = await spawn("--node-id", "b", *cluster)
    a_flags = ("--node-id", "a", "--data-dir", str(tmp_path / "a"), *cluster)
    a = await spawn(*a_flags, "--peers", b.address_text)

    async def both_hold_big(node: NodeProcess) -> None:
        async with node.client() as client:
            got = await client.get_arrays(["big"])
            assert np.array_equal(got.get("big"), BIG)

    async with a.client() as client, b.client() as other:
        await wait_formed({"a": client, "b": other})
        await write_w_and_big(client)
    await eventually(lambda: both_hold_big(b), timeout=20)
    await stop(a)
    flip_partition_byte(tmp_path / "a", index=0)

    a = await spawn(*a_flags, "--peers", b.address_text, "--ignore-corrupt-snapshot")
    await a.wait_stderr("dropped")
    assert "'big'" in a.stderr, a.stderr
    await eventually(lambda: both_hold_big(a), timeout=20)
    async with a.client() as client:
        got = await client.get_parameters(["w"])
        assert [(p.name, p.version) for p in got.params] == [("w", W_VERSION)]


async def test_a_damaged_log_names_the_flag_that_starts_it_and_what_that_loses(
    tmp_path: Path,
) -> None:
    image, _ = await log_image(tmp_path)
    split_segment(image, 3)  # (records 0-2 in segment 1, 3-5 in segment 2)
    first, second = segment_path(image, 1), segment_path(image, 2)
    pos, size = record_spans(first.read_bytes())[1]
    flip_byte(first, pos + RECORD.size + size // 2)
    damaged, after = first.read_bytes(), second.read_bytes()
    message = str(await refused(image))
    assert str(first) in message and f"byte {pos}" in message, message
    assert "--ignore-corrupt-log" in message and second.name in message, message
    assert first.read_bytes() == damaged, "nothing is cut"
    # What the flag keeps: the log up to the damage (record 0).
    expected_dir = tmp_path / "expected"
    shutil.copytree(image, expected_dir)
    segment_path(expected_dir, 1).write_bytes(damaged[:pos])
    segment_path(expected_dir, 2).unlink()
    expected, _ = recover_into_table(expected_dir)
    assert expected
    async with running(image, ignore_corrupt_log=True) as node:
        assert table_state(node.table) == expected
    kept = sorted(p.name for p in image.iterdir() if ".corrupt-" in p.name)
    assert [name.split(".corrupt-")[0] for name in kept] == [first.name, second.name], kept
    assert [(image / name).read_bytes() for name in kept] == [damaged, after]
    async with running(image) as node:  # (no flag needed any more)
        assert table_state(node.table) == expected
