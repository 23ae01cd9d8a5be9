"""Every limit answers with a clear typed error or a close, and the node keeps serving."""

from __future__ import annotations

import numpy as np
import pytest

from aioparamsync import ErrorCode, Indeterminate, NetworkError, Node, ParameterClient, RequestError
from aioparamsync.store.table import Limits


async def test_connections_over_the_limit_are_refused_and_the_others_served() -> None:
    async with Node("127.0.0.1", 0, max_connections=2) as node:
        first = ParameterClient(node.address, max_connections=1)
        second = ParameterClient(node.address, max_connections=1)
        third = ParameterClient(node.address, max_connections=1, timeout=10)
        try:
            assert await first.ping() and await second.ping()
            with pytest.raises(NetworkError):
                await third.ping()
            assert node.server.counters["connections_refused"] >= 1
            assert await first.update_arrays({"w": [1.0]}) == {"w": 1}
        finally:
            for client in (first, second, third):
                await client.close()


async def test_request_limits_answer_limit_exceeded() -> None:
    limits = Limits(max_name_bytes=8, max_params_per_update=2, max_names_per_request=3)
    async with Node("127.0.0.1", 0, limits=limits) as node, ParameterClient(node.address) as c:
        cases = [
            c.get_parameters(["a", "b", "c", "d"]),
            c.update_arrays({"a": [1], "b": [2], "c": [3]}),
            c.update_arrays({"123456789": [1]}),
        ]
        for call in cases:
            with pytest.raises(RequestError) as info:
                await call
            assert info.value.code == ErrorCode.LIMIT_EXCEEDED
        assert await c.update_arrays({"a": [1], "b": [2]}) == {"a": 1, "b": 1}
        assert len(node.table) == 2


async def test_a_write_past_its_deadline_is_answered_indeterminate(tmp_path) -> None:
    # Logging 32 MiB with fsync takes far longer than the half-millisecond deadline.
    async with (
        Node("127.0.0.1", 0, request_timeout=0.0005, data_dir=tmp_path, fsync="always") as node,
        ParameterClient(node.address) as client,
    ):
        with pytest.raises(Indeterminate, match="not done within") as info:
            await client.update_arrays({"big": np.zeros(4 << 20)})
        assert info.value.code == ErrorCode.INDETERMINATE  # (a write: it may be applied)
        assert node.server.counters["timeouts"] == 1
        # "It may still complete": it does (a read on the same connection waits
        # for the writes before it), and the node goes on serving.
        assert (await client.get_parameters(["big"])).params[0].version == 1
