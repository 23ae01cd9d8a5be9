"""Checkpoints at one cut (``aioparamsync-ctl checkpoint``/``restore``, the client's
``checkpoint()``/``restore()``), and the ``cut`` steps a node takes for them.

Real node processes on loopback, real clients, real files.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from cluster_helpers import (
    ProcessCluster,
    open_clients,
    run_bounded,
    spawn_cluster,
    wait_formed,
)
from safetensors.numpy import load_file

from aioparamsync import (
    CheckpointError,
    ErrorCode,
    Node,
    ParameterClient,
    RequestError,
    sgd,
    sum_rule,
)
from aioparamsync.client.checkpoint import MANIFEST
from aioparamsync.client.restore import read_manifest
from aioparamsync.store.cuts import CallLog, Hold, call_keys, new_call
from aioparamsync.wire import METHODS, thrift

ROUTED = [f"routed.{i}" for i in range(20)]  # written by a routed client, one call a step
BIG = "routed.embedding"  # (partitioned: --partition-bytes 4096) in the same calls
FOUNDING = [f"founding.{i}" for i in range(20)]  # by a client of one node (the node cuts)
SUMS = [f"sum.{i}" for i in range(20)]  # gradients of ones pushed to all 20 in each call
CTL = [sys.executable, "-m", "aioparamsync.ctl"]


def steps_of(directory: Path) -> tuple[dict[str, np.ndarray], dict]:
    """Every parameter in the checkpoint's files, and its manifest."""
    manifest = json.loads((directory / MANIFEST).read_text())
    arrays: dict[str, np.ndarray] = {}
    for file in {p["file"] for p in manifest["parameters"].values()}:
        arrays.update(load_file(directory / file))
    return arrays, manifest


def one_step(arrays: dict[str, np.ndarray], names: list[str]) -> int:
    """The step every one of ``names`` holds (each array filled with it), or fail."""
    steps = {name: set(np.unique(arrays[name]).tolist()) for name in names}
    seen = set().union(*steps.values())
    assert len(seen) == 1, f"a checkpoint holds several steps of one call: {steps}"
    return int(seen.pop())


async def write_steps(client: ParameterClient, names: list[str], big: str | None, stop) -> int:
    step = 0
    while not stop.is_set():
        step += 1
        arrays = {n: np.full(64, step, np.float32) for n in names}
        if big is not None:
            arrays[big] = np.full(5000, step, np.float32)
        await client.update_arrays(arrays)
    return step


async def push_steps(client: ParameterClient, stop) -> int:
    step = 0
    while not stop.is_set():
        step += 1
        await client.push_gradients({n: np.ones(64, np.float32) for n in SUMS})
    return step


@pytest.mark.asyncio
@pytest.mark.parametrize("acks", ["1", "all"])
async def test_a_checkpoint_holds_one_step_of_every_call_and_restores_into_three_nodes(
    tmp_path: Path, acks: str
) -> None:
    async with (
        ProcessCluster(replication_factor="2") as procs,
        contextlib.AsyncExitStack() as stack,
    ):
        extra = ["--partition-bytes", "4096", "--acks", acks]
        nodes = await spawn_cluster(procs, 2, extra=extra)
        await wait_formed(await open_clients(stack, nodes))
        routed = await stack.enter_async_context(ParameterClient(nodes[0].address, timeout=30))
        founding = await stack.enter_async_context(nodes[1].client(timeout=30))
        await routed.update_arrays({"w": np.ones(8, np.float32)}, rules=sgd(lr=0.5))
        await routed.update_arrays({n: np.zeros(64, np.float32) for n in SUMS}, rules=sum_rule())
        await routed.create_table("emb", 4, init="uniform", scale=0.1, buckets=8)
        ids = np.arange(0, 3000, 7, dtype=np.int64)
        await routed.push_row_gradients("emb", ids, np.ones((len(ids), 4), np.float32))

        # Writers each writing one step to 20 parameters in one call, again and
        # again: one routed (its calls cut among the primaries by the client), one
        # of a single node (cut by the node), one pushing gradients (a sum) routed.
        # Checkpoints taken meanwhile.
        stop = asyncio.Event()
        writers = [
            asyncio.ensure_future(write_steps(routed, ROUTED, BIG, stop)),
            asyncio.ensure_future(write_steps(founding, FOUNDING, None, stop)),
            asyncio.ensure_future(push_steps(routed, stop)),
        ]
        seen = []
        try:
            await asyncio.sleep(0.3)
            for i in range(4):
                directory = tmp_path / f"ckpt{i}"
                manifest = await routed.checkpoint(directory)
                assert manifest["torn_calls"] == []
                arrays, _ = steps_of(directory)
                seen.append((one_step(arrays, [*ROUTED, BIG]), one_step(arrays, FOUNDING)))
                assert one_step(arrays, SUMS) >= 1
                await asyncio.sleep(0.1)
        finally:
            stop.set()
            last = await asyncio.gather(*writers)
        assert all(a >= 1 and b >= 1 for a, b in seen), seen
        assert seen[-1][0] > seen[0][0] and last[0] > seen[-1][0]  # (writes went on)

        arrays, manifest = steps_of(tmp_path / "ckpt3")
        assert manifest["parameters"]["w"]["rule"]["kind"] == "sgd"
        assert manifest["tables"]["emb"]["rows"] == len(ids)
        rows_before = await routed.pull_rows("emb", ids)

        # Restored into a cluster of three nodes: every node answers every value.
        async with ProcessCluster(replication_factor="2") as procs3:
            others = await spawn_cluster(procs3, 3, extra=["--partition-bytes", "4096"])
            clients = await open_clients(stack, others)
            await wait_formed(clients)
            target = await stack.enter_async_context(ParameterClient(others[2].address))
            await target.restore(tmp_path / "ckpt3")
            names = sorted(manifest["parameters"])
            for client in clients.values():
                got = await client.get_arrays(names)
                for name in names:
                    np.testing.assert_array_equal(got[name], arrays[name])
                np.testing.assert_array_equal(await client.pull_rows("emb", ids), rows_before)
            # (the rule came back: a gradient folds by it)
            await target.push_gradients({"w": np.ones(8, np.float32)})
            np.testing.assert_allclose((await target.get_arrays(["w"]))["w"], arrays["w"] - 0.5)


@pytest.mark.asyncio
async def test_writes_held_by_a_cut_are_applied_once_it_is_released_or_its_hold_ends() -> None:
    async with (
        Node("127.0.0.1", 0) as node,
        ParameterClient(node.address) as client,
        ParameterClient(node.address) as checkpointer,
    ):
        await client.update_arrays({"a": np.zeros(4, np.float32)})

        # (the steps on connections of their own: a node answers a call only after the
        # writes sent before it on its connection, and a held write is not done)
        async def cut(phase: str, cut_id: str = "c1", **fields):
            request = thrift.CutRequest(id=cut_id, phase=phase, **fields)
            return await checkpointer.invoke(METHODS.cut, request=request)

        await cut("hold")
        write = asyncio.ensure_future(client.update_arrays({"a": np.ones(4, np.float32)}))
        await asyncio.sleep(0.2)
        assert not write.done()  # held
        with pytest.raises(RequestError) as refused:
            await cut("hold", "another")
        assert refused.value.code == ErrorCode.UNAVAILABLE
        taken = await cut("take")
        assert {k.name: k.version for k in taken.keys} == {"a": 1}
        await asyncio.sleep(0.1)
        assert not write.done()  # (still held: until every member took its part)
        await cut("release")
        assert (await write)["a"] == 2  # let in once released
        (old,) = (await cut("read", names=["a"])).params
        assert old.version == 1 and bytes(old.data) == bytes(16)  # the cut's, not the new
        await cut("end")
        with pytest.raises(RequestError):
            await cut("read", names=["a"])

        # A hold ends by itself: the write goes in, and the cut can no longer be taken.
        await cut("hold", "c2", hold_ms=300)
        write = asyncio.ensure_future(client.update_arrays({"a": np.full(4, 2, np.float32)}))
        assert (await asyncio.wait_for(write, 5))["a"] == 3
        with pytest.raises(RequestError) as late:
            await cut("take", "c2")
        assert late.value.code == ErrorCode.TIMEOUT

        for bad in (
            thrift.CutRequest(id="", phase="hold"),
            thrift.CutRequest(id="c3", phase="snap"),
            thrift.CutRequest(id="c3", phase="hold", hold_ms=0),
            thrift.CutRequest(id="c3", phase="hold", hold_ms=10**6),
            thrift.CutRequest(id="nope", phase="take"),
        ):
            with pytest.raises(RequestError):
                await checkpointer.invoke(METHODS.cut, request=bad)
        assert (await client.get_arrays(["a"]))["a"][0] == 2  # (nothing held any more)


@pytest.mark.asyncio
async def test_a_node_alone_checkpoints_and_restores_and_bad_directories_are_refused(
    tmp_path: Path,
) -> None:
    async with Node("127.0.0.1", 0) as node, ParameterClient(node.address) as client:
        model = {
            "fc.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
            "ids": np.arange(5, dtype=np.int64),
            "half": np.ones(3, np.float16),
        }
        await client.update_arrays(model)
        await client.update_parameters([thrift.Parameter(name="raw", data=b"founding")])
        directory = tmp_path / "ckpt"
        manifest = await client.checkpoint(directory)
        assert set(manifest["parameters"]) == {*model, "raw"}
        assert read_manifest(directory)["cut"] == manifest["cut"]
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # (no leftovers)

        # Not over a checkpoint, nor into a file's place.
        with pytest.raises(CheckpointError, match="not an empty directory"):
            await client.checkpoint(directory)
        (tmp_path / "file").write_text("x")
        with pytest.raises(CheckpointError):
            await client.checkpoint(tmp_path / "file")

        await client.update_arrays({"fc.weight": np.zeros((3, 4), np.float32)})
        await client.restore(directory)
        got = await client.get_arrays(list(model))
        for name, value in model.items():
            np.testing.assert_array_equal(got[name], value)
            assert got[name].dtype == value.dtype
        (raw,) = (await client.get_parameters(["raw"])).params
        assert bytes(raw.data) == b"founding" and raw.dtype is None

        # Restoring what is no checkpoint, or a damaged one, writes nothing.
        with pytest.raises(CheckpointError, match="no checkpoint"):
            await client.restore(tmp_path / "missing")
        damaged = tmp_path / "damaged"
        damaged.mkdir()
        for f in directory.iterdir():
            (damaged / f.name).write_bytes(f.read_bytes())
        data = damaged / manifest["parameters"]["fc.weight"]["file"]
        blob = bytearray(data.read_bytes())
        blob[-1] ^= 0xFF  # (the last tensor's last byte)
        data.write_bytes(bytes(blob))
        await client.update_arrays({n: np.zeros_like(v) for n, v in model.items()})
        with pytest.raises(CheckpointError, match="checksum"):
            await client.restore(damaged)
        assert not (await client.get_arrays(list(model)))["fc.weight"].any()  # unchanged
        (damaged / MANIFEST).write_text('{"format": "something else"}')
        with pytest.raises(CheckpointError, match="manifest"):
            await client.restore(damaged)
        (damaged / MANIFEST).write_text("{not json")
        with pytest.raises(CheckpointError, match="cannot be read"):
            await client.restore(damaged)


@pytest.mark.asyncio
async def test_ctl_checkpoint_and_restore(tmp_path: Path) -> None:
    async with Node("127.0.0.1", 0) as node, ParameterClient(node.address) as client:
        await client.update_arrays({"a": np.arange(6, dtype=np.float32)})
        address = f"127.0.0.1:{node.address[1]}"
        directory = tmp_path / "ckpt"
        code, out, err = await asyncio.to_thread(
            run_bounded, [*CTL, "checkpoint", address, str(directory)], 60
        )
        assert code == 0, err
        assert "wrote 1 parameters" in out
        await client.update_arrays({"a": np.zeros(6, np.float32)})
        code, out, err = await asyncio.to_thread(
            run_bounded, [*CTL, "--json", "restore", address, str(directory)], 60
        )
        assert code == 0, err
        assert json.loads(out)["parameters"] == 1
        np.testing.assert_array_equal(
            (await client.get_arrays(["a"]))["a"], np.arange(6, dtype=np.float32)
        )
        code, out, err = await asyncio.to_thread(
            run_bounded, [*CTL, "checkpoint", address, str(directory)], 60
        )
        assert code == 1 and "not an empty directory" in err
        code, out, err = await asyncio.to_thread(
            run_bounded, [*CTL, "checkpoint", address, str(tmp_path / "x"), "--hold", "0"], 60
        )
        assert code == 2 and "--hold" in err


@pytest.mark.asyncio
async def test_assign_rows_sets_rows_and_refuses_repeated_ids() -> None:
    async with Node("127.0.0.1", 0) as node, ParameterClient(node.address) as client:
        await client.create_table("t", 3, init="normal", scale=1.0)
        ids = np.array([5, 1, 9], np.int64)
        values = np.arange(9, dtype=np.float32).reshape(3, 3)
        result = await client.assign_rows("t", ids, values)
        assert (result.rows, result.created) == (3, 3)
        np.testing.assert_array_equal(await client.pull_rows("t", ids), values)
        with pytest.raises(RequestError, match="repeat"):
            await client.assign_rows("t", np.array([1, 1], np.int64), np.zeros((2, 3)))
        with pytest.raises(ValueError, match="rows are"):
            await client.assign_rows("t", ids, np.zeros((3, 2), np.float32))
        np.testing.assert_array_equal(await client.pull_rows("t", ids), values)


def test_the_call_log_keeps_split_calls_only_and_is_bounded() -> None:
    log = CallLog(max_calls=3)
    whole, split = new_call(2), new_call(3)
    assert call_keys(split) == 3 and call_keys("no-count") == 0 and call_keys("x:-4") == 0
    log.add(whole, [thrift.Parameter(name=n, data=b"") for n in ("a", "b")])
    log.add(split, [thrift.Parameter(name="a", data=b"")])
    log.add(split, [thrift.Parameter(name="b", data=b"")])
    assert log.report() == {split: ["a", "b"]}
    for _ in range(5):
        log.add(new_call(9), [thrift.Parameter(name="a", data=b"")])
    assert len(log) == 3 and split not in log.report()
    hold = Hold()
    hold.held = [(None,) * 5 + (split,), (None,) * 5 + (None,)]
    assert hold.admit([split]) == [(None,) * 5 + (split,)]
    assert hold.admits(split) and not hold.admits(None) and len(hold.held) == 1
