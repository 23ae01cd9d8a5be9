"""``aioparamsync-ctl export``: a running cluster's parameters in a safetensors file.

Real nodes (in this process, and a cluster of node processes), ``main(argv)``
run as a shell would, real files read back with the ``safetensors`` package
(numpy and torch), and what goes wrong: no file is left behind then.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
from cluster_helpers import (
    ProcessCluster,
    node_client,
    open_clients,
    spawn_cluster,
    wait_formed,
)
from safetensors import safe_open

from aioparamsync import Node, ParameterClient, thrift
from aioparamsync.cli.ctl import main
from aioparamsync.placement import manifest_key, partition_key

pytestmark = pytest.mark.timeout(120)

RUN_TIMEOUT = 60.0
KIB = 1024
# The nodes' --partition-bytes here: parameters over 16 KiB of float32 are partitioned.
PARTITION = 16 * KIB

ARRAYS = {
    "layer1.weight": np.arange(64 * 200, dtype=np.float32).reshape(64, 200) / 7,  # partitioned
    "layer1.bias": np.linspace(-1, 1, 64, dtype=np.float32),
    "embed": np.arange(3 * 5000, dtype=np.float16).reshape(3, 5000),  # partitioned
    "steps": np.array(12345678901, dtype=np.int64),  # no dimension
    "mask": np.array([True, False, True]),
    "bf": np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 3),
    "big_endian": np.arange(5, dtype=">f8"),
    "empty": np.zeros((0, 4), np.float32),
    "u8": np.arange(40000, dtype=np.uint64).astype(np.uint8),  # partitioned (elements)
}
PLAIN = b"plain bytes from a founding client"


def text(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"


async def ctl(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    async with asyncio.timeout(RUN_TIMEOUT):
        rc = await asyncio.to_thread(main, list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


async def fill(client: ParameterClient) -> dict[str, int]:
    versions = await client.update_arrays(ARRAYS)
    versions |= await client.update_arrays({"layer1.bias": ARRAYS["layer1.bias"]})  # version 2
    plain = thrift.Parameter(name="plain", data=PLAIN, version=7)
    versions |= await client.update_parameters([plain])
    return versions


def expected(name: str) -> np.ndarray:
    if name == "plain":
        return np.frombuffer(PLAIN, np.uint8)
    return ARRAYS[name]


def assert_exported(path: Path, versions: dict[str, int], names: list[str]) -> None:
    """The file holds ``names``, whole, as numpy and torch read it, and their versions."""
    got = safetensors.numpy.load_file(path)
    assert sorted(got) == sorted(names)
    for name in names:
        want = expected(name)
        if want.dtype.byteorder == ">":  # (safetensors holds little-endian values)
            want = want.astype(want.dtype.newbyteorder("<"))
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    as_torch = safetensors.torch.load_file(path)
    assert {n: tuple(t.shape) for n, t in as_torch.items()} == {n: expected(n).shape for n in names}
    assert str(as_torch["bf"].dtype) == "torch.bfloat16" if "bf" in names else True
    with safe_open(path, "np") as f:
        metadata = f.metadata()
    assert metadata["format"] == "aioparamsync export 1"
    assert json.loads(metadata["versions"]) == {n: versions[n] for n in names}
    assert int(metadata["timestamp"]) > 0


def files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def leftovers(directory: Path) -> list[str]:
    return [name for name in files_in(directory) if name.endswith(".tmp")]


@pytest.fixture
async def filled() -> AsyncIterator[tuple[Node, dict[str, int]]]:
    async with Node("127.0.0.1", 0, partition_bytes=PARTITION) as node:
        async with ParameterClient(node.address) as client:
            versions = await fill(client)
            await client.create_table("clicks", 8)
        yield node, versions


# -- what it writes -----------------------------------------------------------------------


async def test_every_parameter_whole_under_its_name(filled, tmp_path: Path, capsys) -> None:
    node, versions = filled
    assert any("\x00" in k for k in node.table.names())  # (some are stored as partitions)
    path = tmp_path / "model.safetensors"
    rc, out, err = await ctl(capsys, "export", text(node.address), str(path))
    assert (rc, err) == (0, ""), err
    names = [*ARRAYS, "plain"]
    assert out.startswith(f"wrote {len(names)} parameters (")
    assert out.rstrip().endswith(f"to {path}; 1 embedding tables not written (clicks)")
    assert_exported(path, versions, names)
    assert versions["layer1.bias"] == 2 and versions["plain"] == 7
    assert leftovers(tmp_path) == []


async def test_the_names_given_and_json(filled, tmp_path: Path, capsys) -> None:
    node, versions = filled
    path = tmp_path / "some.safetensors"
    rc, out, err = await ctl(
        capsys, "--json", "export", text(node.address), str(path), "embed", "plain", "embed"
    )
    assert (rc, err) == (0, ""), err
    document = json.loads(out)
    assert document["file"] == str(path) and document["parameters"] == 2
    assert document["bytes"] == ARRAYS["embed"].nbytes + len(PLAIN)
    assert document["versions"] == {"embed": versions["embed"], "plain": 7}
    assert document["tables"] == ["clicks"]
    assert_exported(path, versions, ["embed", "plain"])


async def test_a_file_there_is_replaced(filled, tmp_path: Path, capsys) -> None:
    node, versions = filled
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"an older export")
    rc, _, err = await ctl(capsys, "export", text(node.address), str(path), "mask")
    assert (rc, err) == (0, "")
    assert_exported(path, versions, ["mask"])


async def test_a_cluster_s_partitions_are_read_where_they_are_and_put_together(
    tmp_path: Path, capsys
) -> None:
    async with ProcessCluster(replication_factor="1") as procs:
        nodes = await spawn_cluster(procs, 3, extra=["--partition-bytes", str(PARTITION)])
        async with contextlib.AsyncExitStack() as stack:
            await wait_formed(await open_clients(stack, nodes))
        async with node_client(nodes[0].address, timeout=30) as client:
            versions = await fill(client)
        held = []
        for n in nodes:
            async with n.client() as alone:
                held.append((await alone.info()).parameter_count)
        assert all(held), held  # (R=1: the partitions are spread over the three)
        # A routed read of a manifest's key, or a partition's, answers it as it is (the
        # export reads a partitioned parameter so, a partition at a time).
        async with ParameterClient(nodes[2].address, timeout=30) as routed:
            assert routed.routes is not None
            await routed.routes.learn()
            keys = [manifest_key("embed"), partition_key("embed", 1)]
            assert [p.name for p in (await routed.get_parameters(keys)).params] == keys
        path = tmp_path / "cluster.safetensors"
        rc, _, err = await ctl(capsys, "export", nodes[1].address_text, str(path))
        assert (rc, err) == (0, ""), err
        assert_exported(path, versions, [*ARRAYS, "plain"])


# -- what goes wrong: a clear line, a code, and no file --------------------------------------


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["nope"], "no parameter 'nope'"),
        (["clicks"], "'clicks' is an embedding table: tables are not exported"),
        (["embed\x00#0"], "'embed\\x00#0' is no parameter's name (a key of 'embed': name it)"),
    ],
    ids=["unknown", "table", "partition-key"],
)
async def test_a_name_that_is_no_parameter_exits_3_and_writes_nothing(
    filled, tmp_path: Path, capsys, names: list[str], message: str
) -> None:
    node, _ = filled
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"kept")
    rc, out, err = await ctl(capsys, "export", text(node.address), str(path), "mask", *names)
    assert rc == 3 and out == "", (out, err)
    assert err == f"aioparamsync-ctl: {message} on {text(node.address)}; nothing written\n"
    assert path.read_bytes() == b"kept" and leftovers(tmp_path) == []


async def test_a_path_that_cannot_be_written_exits_1(filled, tmp_path: Path, capsys) -> None:
    node, _ = filled
    for path, why in [
        (tmp_path / "missing" / "model.safetensors", "No such file or directory"),
        (tmp_path, "it is a directory"),
    ]:
        rc, out, err = await ctl(capsys, "export", text(node.address), str(path))
        assert rc == 1 and out == "", err
        assert err == f"aioparamsync-ctl: cannot write {path}: {why}\n"
    assert leftovers(tmp_path) == []


async def test_an_unreachable_node_exits_1_and_writes_nothing(tmp_path: Path, capsys) -> None:
    async with Node("127.0.0.1", 0) as node:
        address = text(node.address)
    path = tmp_path / "model.safetensors"
    rc, out, err = await ctl(capsys, "--timeout", "5", "export", address, str(path))
    assert rc == 1 and out == "" and err.count("\n") == 1, err
    assert address in err and "Traceback" not in err
    assert files_in(tmp_path) == []


async def test_a_dtype_safetensors_has_no_name_for_exits_1(tmp_path: Path, capsys) -> None:
    async with Node("127.0.0.1", 0) as node:
        async with ParameterClient(node.address) as client:
            await client.update_arrays({"z": np.ones(3, np.complex128), "w": np.ones(2)})
        path = tmp_path / "model.safetensors"
        rc, out, err = await ctl(capsys, "export", text(node.address), str(path))
        assert rc == 1 and out == "", err
        assert "'z' is complex128, which safetensors has no dtype for" in err
        assert files_in(tmp_path) == []
        rc, _, err = await ctl(capsys, "export", text(node.address), str(path), "w")
        assert (rc, err) == (0, "")


def test_help_says_what_the_file_holds_and_what_it_leaves_out(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "uint8, one-dimensional" in shown
    assert "Embedding tables are not written" in shown
    assert "safetensors.numpy.load_file" in shown and "[export]" in shown


# -- memory -------------------------------------------------------------------------------


# Runs aioparamsync-ctl, and says its peak resident memory as its own /proc/self/status has
# it at exit (VmHWM starts again at exec: ru_maxrss would count the forked parent's image).
PEAK_OF_CTL = """import atexit, sys
def peak():
    with open("/proc/self/status") as f:
        print(next(line for line in f if line.startswith("VmHWM:")), end="", file=sys.stderr)
atexit.register(peak)
from aioparamsync.cli.ctl import main
from aioparamsync.placement import manifest_key, partition_key
sys.exit(main(sys.argv[1:]))
"""


def peak_rss(*argv: str) -> tuple[int, int]:
    """Run ``aioparamsync-ctl *argv``; answer its exit code and peak resident memory (bytes)."""
    proc = subprocess.run(
        [sys.executable, "-c", PEAK_OF_CTL, *argv],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    line = proc.stderr.splitlines()[-1]
    assert line.startswith("VmHWM:") and line.endswith(" kB"), proc.stderr
    return proc.returncode, int(line.split()[1]) * 1024


async def test_memory_holds_one_partition_or_batch_not_the_model(tmp_path: Path) -> None:
    mib = 1024 * 1024
    arrays = {f"w{i}": np.full(8 * mib // 4, i, np.float32) for i in range(12)}  # 96 MiB
    async with Node("127.0.0.1", 0, partition_bytes=mib) as node:
        async with ParameterClient(node.address) as client:
            for name, array in arrays.items():
                await client.update_arrays({name: array})
        rc, idle = await asyncio.to_thread(peak_rss, "list", text(node.address))
        assert rc == 0
        path = tmp_path / "model.safetensors"
        rc, peak = await asyncio.to_thread(peak_rss, "export", text(node.address), str(path))
        assert rc == 0
    assert path.stat().st_size > 96 * mib
    grown = peak - idle
    # (what it holds at once: a partition of 1 MiB, or a batch of BATCH_BYTES at most)
    assert grown < 24 * mib, f"the export held {grown / mib:.0f} MiB more than a listing"


def test_the_export_extra_installs_what_reads_the_file() -> None:
    import tomllib

    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    extras = project["project"]["optional-dependencies"]
    assert any(r.startswith("safetensors") for r in extras["export"])
    # (the export itself needs no package: the format is written by our own code)
    assert not any(r.startswith("safetensors") for r in project["project"]["dependencies"])
