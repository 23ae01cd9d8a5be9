"""Gradients holding NaN or inf are refused, whole, unless the parameter's rule allows them.

A node process (``python -m aioparamsync``) on 127.0.0.1 for pushes of
parameters and of rows; in-process nodes for the paths a push may take on
the way to its fold (a large parameter's partitions, an encoding, a part
passed on to its owner) and for the rule's option surviving a restart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cluster_helpers import LocalCluster, Spawn, primary_of

from aioparamsync import (
    ErrorCode,
    Node,
    ParameterClient,
    RequestError,
    adagrad,
    adam,
    sgd,
    sum_rule,
    thrift,
)
from aioparamsync.values import rules

pytestmark = pytest.mark.timeout(60)


def with_bad(n: int, value: float, *, at: tuple[int, ...] = (), dtype: Any = np.float32) -> Any:
    """``n`` ones with ``value`` at the flat positions ``at``."""
    g = np.ones(n, dtype)
    for i in at:
        g[i] = value
    return g


async def state(client: ParameterClient, names: list[str]) -> dict[str, tuple[int, bytes]]:
    """Each name's version and bytes, as the node answers them."""
    got = await client.get_parameters(names)
    return {p.name: (p.version, bytes(p.data)) for p in got.params}


async def refused(call: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        await call
    return info.value


# -- parameters, on a node process -------------------------------------------------------------


async def test_nan_and_inf_gradients_are_refused_and_nothing_is_folded(spawn: Spawn) -> None:
    node = await spawn()
    async with node.client() as client:
        await client.update_arrays(
            {"w": np.zeros(8, np.float32), "b": np.zeros(8, np.float32)},
            rules={"w": sgd(0.5), "b": sum_rule()},
        )
        await client.push_gradients({"w": np.ones(8, np.float32)})
        before = await state(client, ["w", "b"])
        assert {n: v for n, (v, _) in before.items()} == {"w": 2, "b": 1}
        for value, at in ((np.nan, (3,)), (np.inf, (0, 7)), (-np.inf, (1, 2, 5))):
            error = await refused(client.push_gradients({"w": with_bad(8, value, at=at)}))
            assert error.code == ErrorCode.BAD_REQUEST, error
            assert "'w'" in error.message and f"holds {len(at)} of 8 values" in error.message
            assert "not finite" in error.message and "allow_nonfinite" in error.message
            assert await state(client, ["w", "b"]) == before
        # One bad gradient in a push of two: neither is folded.
        mixed = {"b": np.ones(8, np.float32), "w": with_bad(8, np.nan, at=(4,))}
        error = await refused(client.push_gradients(mixed))
        assert error.code == ErrorCode.BAD_REQUEST and "'w'" in error.message
        assert await state(client, ["w", "b"]) == before
        # The same push, finite, folds both.
        assert await client.push_gradients(
            {"b": np.ones(8, np.float32), "w": np.ones(8, np.float32)}
        ) == {
            "b": 2,
            "w": 3,
        }


async def test_a_rule_that_allows_nonfinite_gradients_folds_them(spawn: Spawn) -> None:
    node = await spawn()
    async with node.client() as client:
        await client.update_arrays(
            {"w": np.zeros(4, np.float32), "a": np.zeros(4)},
            rules={"w": sum_rule(allow_nonfinite=True), "a": adam(0.1, allow_nonfinite=True)},
        )
        versions = await client.push_gradients(
            {"w": with_bad(4, np.inf, at=(1,)), "a": with_bad(4, np.nan, at=(0,), dtype="f8")}
        )
        assert versions == {"w": 2, "a": 2}
        got = await client.get_arrays(["w", "a"])
        assert np.isinf(got["w"][1]) and np.isfinite(got["w"][[0, 2, 3]]).all()
        assert np.isnan(got["a"][0])
        rule = (await client.get_parameters(["w"])).params[0].rule
        assert rule.kind == "sum" and rule.allow_nonfinite is True


def test_every_rule_constructor_has_the_option_off_by_default() -> None:
    made = [sum_rule(), sgd(0.1), adam(0.1), adagrad(0.1)]
    assert [r.allow_nonfinite for r in made] == [False] * 4
    allowed = [
        sum_rule(allow_nonfinite=True),
        sgd(0.1, allow_nonfinite=True),
        adam(0.1, allow_nonfinite=True),
        adagrad(0.1, allow_nonfinite=True),
    ]
    assert [r.allow_nonfinite for r in allowed] == [True] * 4


def test_a_rule_whose_option_is_not_a_bool_is_refused() -> None:
    with pytest.raises(RequestError, match="allow_nonfinite is True or False") as info:
        rules.check_rule("w", thrift.Rule(kind="sum", allow_nonfinite="yes"))
    assert info.value.code == ErrorCode.BAD_REQUEST


async def test_a_bad_gradient_is_refused_after_decoding_and_in_a_partition() -> None:
    per = 1024  # partition_bytes 4096: a parameter of 3000 float32 has 3 partitions
    async with (
        Node("127.0.0.1", 0, partition_bytes=4 * per) as node,
        ParameterClient(node.address, timeout=10) as client,
    ):
        await client.update_arrays(
            {"big": np.zeros(3000, np.float32), "s": np.zeros(8, np.float32)}, rules=sgd(1.0)
        )
        before = await state(client, ["big", "s"])
        # A NaN in the last partition only; the other two are not folded either.
        error = await refused(client.push_gradients({"big": with_bad(3000, np.nan, at=(2500,))}))
        assert error.code == ErrorCode.BAD_REQUEST, error
        assert "big" in error.message and "holds 1 of" in error.message
        assert "\\x00" not in error.message
        # Encoded: fp16 and topk carry NaN and inf through; decoded, they are refused.
        for encoding in ("fp16", "topk"):
            error = await refused(
                client.push_gradients(
                    {"s": with_bad(8, np.inf, at=(6,))}, encoding=encoding, ratio=0.5
                )
            )
            assert error.code == ErrorCode.BAD_REQUEST and "'s'" in error.message, encoding
        assert await state(client, ["big", "s"]) == before


async def test_a_bad_gradient_passed_on_to_its_owner_is_refused_there() -> None:
    cluster = LocalCluster(replication_factor=1)  # each name at one node: pushes pass on
    try:
        a = await cluster.start()
        b = await cluster.start(peers=[a])
        await cluster.formed([a, b])
        names = [f"p{i}" for i in range(64)]  # (all 64 at a: once in 2**64 runs; 8 failed)
        async with ParameterClient(a.address, route=False, timeout=10) as client:
            await client.update_arrays({n: np.zeros(4, np.float32) for n in names}, rules=sgd(1.0))
            elsewhere = next(n for n in names if primary_of([a, b], n) is b)
            before = await state(client, names)
            error = await refused(client.push_gradients({elsewhere: with_bad(4, np.nan, at=(0,))}))
            assert error.code == ErrorCode.BAD_REQUEST and repr(elsewhere) in error.message
            assert await state(client, names) == before
    finally:
        await cluster.close()


async def test_the_option_survives_a_restart(tmp_path: Path) -> None:
    async with (
        Node("127.0.0.1", 0, data_dir=tmp_path) as node,
        ParameterClient(node.address, timeout=10) as client,
    ):
        await client.update_arrays(
            {"free": np.zeros(2, np.float32), "kept": np.zeros(2, np.float32)},
            rules={"free": sgd(1.0, allow_nonfinite=True), "kept": sgd(1.0)},
        )
    async with (
        Node("127.0.0.1", 0, data_dir=tmp_path) as node,
        ParameterClient(node.address, timeout=10) as client,
    ):
        assert await client.push_gradients({"free": with_bad(2, np.nan, at=(0,))}) == {"free": 2}
        error = await refused(client.push_gradients({"kept": with_bad(2, np.nan, at=(0,))}))
        assert error.code == ErrorCode.BAD_REQUEST


# -- rows --------------------------------------------------------------------------------------


async def test_nonfinite_row_gradients_are_refused_unless_the_rule_allows(spawn: Spawn) -> None:
    node = await spawn()
    ids = np.array([1, 2, 70], np.int64)
    async with node.client() as client:
        await client.create_table("t", 4, rule=adagrad(0.1))
        await client.create_table("free", 4, rule=adagrad(0.1, allow_nonfinite=True))
        await client.push_row_gradients("t", ids, np.ones((3, 4), np.float32))
        before = await client.pull_rows("t", ids)
        grads = np.ones((3, 4), np.float32)
        grads[0, 1], grads[2, 3] = np.nan, np.inf
        error = await refused(client.push_row_gradients("t", ids, grads))
        assert error.code == ErrorCode.BAD_REQUEST, error
        assert "'t'" in error.message and "holds 2 of 12 values" in error.message
        assert "not finite" in error.message
        np.testing.assert_array_equal(await client.pull_rows("t", ids), before)
        # (the rows of the other ids, finite, were not folded either)
        assert (await client.push_row_gradients("free", ids, grads)).rows == 3
        got = await client.pull_rows("free", ids)
        assert np.isnan(got[0, 1]) and np.isfinite(got[1]).all()
        [table] = [t for t in await client.tables() if t.name == "free"]
        assert table.rule.allow_nonfinite is True
