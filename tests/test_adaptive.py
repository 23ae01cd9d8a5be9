"""Adaptive synchronization: the controllers' decisions from synthetic figures, and a slow link.

The controllers (values/adaptive.py) are pure: fed made-up measurements,
their choices are checked without sockets. Then ``encoding="auto"`` through
a node behind benchmarks/throttle.py, a link throttled on loopback.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from aioparamsync import Node, ParameterClient
from aioparamsync.values.adaptive import (
    PULL_CHOICES,
    Choice,
    EncodingController,
    Link,
    StalenessController,
)

pytestmark = pytest.mark.timeout(120)

_BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, _BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


throttle = _load("throttle")
bench = _load("bench_adaptive")

MB = 1_000_000
SLOW = 12.5 * MB  # 100 Mbit/s in bytes/s


def link_of(rtt: float, rate: float, sizes: list[int]) -> Link:
    link = Link()
    for n in sizes:
        link.observe(n, rtt + n / rate)
    return link


# -- the link's model ---------------------------------------------------------------------


def test_a_link_of_calls_of_several_sizes_fits_its_round_trip_and_throughput() -> None:
    link = link_of(0.005, SLOW, [1_000, 100_000, 1_000_000, 250_000, 4_000_000])
    rtt, rate = link.fit()
    assert rtt == pytest.approx(0.005, rel=1e-6) and rate == pytest.approx(SLOW, rel=1e-6)
    assert link.seconds(2_000_000) == pytest.approx(0.005 + 0.16)


def test_a_link_of_one_size_puts_its_time_on_the_bytes_unless_small_calls_show_the_rtt() -> None:
    # Pushes of one size only: rtt and throughput cannot be told apart; all of
    # the time goes on the bytes (the cautious reading: it favours compression).
    link = link_of(0.005, SLOW, [1_000_000] * 5)
    assert link.fit() == pytest.approx((0.0, 1_000_000 / (0.005 + 1_000_000 / SLOW)))
    # Two sizes only (fewer than three calls): the small one gives the round trip.
    link = link_of(0.005, SLOW, [1_000_000, 200])
    rtt, rate = link.fit()
    assert rtt == pytest.approx(0.005 + 200 / SLOW) and rate == pytest.approx(SLOW, rel=1e-3)


def test_a_link_without_calls_is_free_and_bad_samples_are_ignored() -> None:
    link = Link()
    for nbytes, seconds in [(100, 0.0), (100, -1.0), (-5, 0.1), (100, math.inf), (100, math.nan)]:
        link.observe(nbytes, seconds)
    assert not link.known and link.fit() == (0.0, math.inf) and link.seconds(10**9) == 0.0


# -- encoding="auto" ----------------------------------------------------------------------


def controller(rtt: float, rate: float, compute: float, target: float = 0.2):
    auto = EncodingController(target)
    for n in (1_000, 100_000, 1_000_000, 4_000_000):
        auto.observe_call(n, rtt + n / rate)
    auto.observe_compute(compute)
    return auto


GRAD = {"w": (4_000_000, 4)}  # 1M float32


def test_nothing_measured_yet_sends_raw() -> None:
    assert EncodingController().choose(GRAD) == Choice(None)


def test_a_fast_link_sends_raw() -> None:
    # 10 GB/s, 50 us: 4 MB in 0.45 ms, under 0.25 x 100 ms of compute.
    assert controller(50e-6, 10_000 * MB, 0.1).choose(GRAD) == Choice(None)


def test_a_slow_link_compresses_as_little_as_keeps_under_the_target() -> None:
    # 100 Mbit/s, 5 ms; compute 1 s: raw (0.325 s) > 0.25 s allowed, bf16 (0.165 s) fits.
    assert controller(0.005, SLOW, 1.0).choose(GRAD) == Choice("bf16")
    # compute 0.4 s: 0.1 s allowed: int8 (0.085 s) is the least lossy that fits.
    assert controller(0.005, SLOW, 0.4).choose(GRAD) == Choice("int8")
    # compute 0.1 s: 25 ms allowed: top-k 1% (predicted 3% of the bytes, 0.015 s).
    assert controller(0.005, SLOW, 0.1).choose(GRAD) == Choice("topk", 0.01)
    # A larger target allows more: raw fits in half of a 1 s step.
    assert controller(0.005, SLOW, 1.0, target=0.5).choose(GRAD) == Choice(None)


def test_when_nothing_fits_the_cheapest_is_chosen() -> None:
    # 1 ms of compute: nothing fits in 0.25 ms; the round trip alone is 5 ms.
    auto = controller(0.005, SLOW, 0.001)
    assert auto.choose(GRAD) == Choice("topk", 0.01)
    stats = auto.stats()
    assert stats["chosen"] == "topk 0.01" and stats["allowed_seconds"] == pytest.approx(0.00025)
    assert stats["predicted_seconds"]["none"] == pytest.approx(0.005 + 4_000_000 / SLOW)


def test_what_an_encoding_really_sent_and_cost_replaces_the_guess() -> None:
    auto = controller(0.005, SLOW, 0.1)
    # Top-k went raw (a dense gradient: its bound needed most values) ...
    for choice in (Choice("topk", 0.01), Choice("topk", 0.1)):
        auto.observe_encode(choice, 4_000_000, 4_000_000, 0.001, "w")
    # ... so int8 is cheaper, though it does not fit either: the cheapest it is.
    assert auto.choose(GRAD) == Choice("int8")
    # An encoding whose CPU time outweighs what it saves on a fast link loses there.
    fast = controller(50e-6, 10_000 * MB, 0.001)
    fast.observe_encode(Choice("bf16"), 4_000_000, 2_000_000, 0.05, "w")
    fast.observe_encode(Choice("int8"), 4_000_000, 1_000_000, 0.05, "w")
    fast.observe_encode(Choice("topk", 0.1), 4_000_000, 4_000_000, 0.05, "w")
    fast.observe_encode(Choice("topk", 0.01), 4_000_000, 4_000_000, 0.05, "w")
    assert fast.choose(GRAD) == Choice(None)


def test_pulls_choose_among_raw_and_bf16_only() -> None:
    auto = EncodingController(choices=PULL_CHOICES)
    for n in (1_000, 1_000_000, 4_000_000):
        auto.observe_call(n, 0.005 + n / SLOW)
    auto.observe_compute(0.001)
    assert auto.choose(GRAD) == Choice("bf16")


@pytest.mark.parametrize("target", [0, 1, -0.1, 1.5, math.nan, "0.2", None])
def test_a_target_out_of_range_is_refused(target: object) -> None:
    with pytest.raises(ValueError, match="target is a share"):
        EncodingController(target)  # type: ignore[arg-type]


# -- staleness="auto" ---------------------------------------------------------------------


def test_staleness_grows_while_reads_wait_and_shrinks_when_the_loss_stalls() -> None:
    ssp = StalenessController(2, high=4, window=5)
    loss = 10.0
    for _ in range(25):  # waiting 30% of each step, the loss falling: grows, to its high
        loss *= 0.9
        ssp.observe_step(1.0, 0.3, loss)
    assert ssp.bound == 4 and [b for _, b, _ in ssp.changes] == [3, 4]
    for _ in range(5):  # the loss stops falling: halved
        ssp.observe_step(1.0, 0.3, loss)
    assert ssp.bound == 2 and ssp.changes[-1][2] == "loss stopped improving"
    for _ in range(5):  # no waiting, loss falling again: unchanged
        loss *= 0.9
        ssp.observe_step(1.0, 0.0, loss)
    assert ssp.bound == 2 and ssp.stats()["bound"] == 2


@pytest.mark.parametrize(
    "kwargs",
    [{"initial": -1}, {"initial": 5, "high": 4}, {"initial": 1, "low": 2}, {"window": 0}],
)
def test_a_staleness_range_that_makes_no_sense_is_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="staleness needs"):
        StalenessController(**kwargs)


# -- through a node, on a throttled link --------------------------------------------------


async def test_auto_compresses_on_a_slow_link_and_stops_when_it_is_fast(node: Node) -> None:
    # 256 KiB of float32: 21 ms at 100 Mbit/s (+5 ms), about 1 ms on loopback; 50 ms of
    # compute allow 12.5 ms: raw fits only on loopback, int8 (10 ms) on the slow link.
    dim = 65536
    link = throttle.Throttle(node.address, mbit=100, rtt_ms=5)
    async with link, ParameterClient(link.address, timeout=60) as client:
        slow = await bench.time_to_goal(
            link.address,
            "w",
            {"encoding": "auto"},
            dim=dim,
            compute=0.05,
            goal=1e-3,
            max_steps=60,
            client=client,
        )
        assert slow["reached"], slow
        chosen = slow["chosen"]
        # Raw only while nothing is measured (the first push or two), compressed after.
        assert chosen.get("none", 0) <= 2 and sum(chosen.values()) == slow["steps"], chosen
        link.set(mbit=0, rtt_ms=0)  # the link becomes fast
        h, star = bench.problem(dim)
        before = dict(client.stats()["auto"]["counts"])
        for _ in range(40):
            w = (await client.get_arrays(["w"]))["w"]
            await asyncio.sleep(0.05)  # the same compute time
            await client.push_gradients({"w": h * (w - star)}, encoding="auto")
        after = client.stats()["auto"]["counts"]
        fast = {c: after.get(c, 0) - before.get(c, 0) for c in after}
        assert fast.get("none", 0) >= 20, (chosen, fast, client.stats()["auto"])

        def lossiness(counts: dict[str, int]) -> float:  # 0 for none ... 4 for top-k 1%
            order = [str(c) for c in bench.PUSH_CHOICES]
            return sum(order.index(c) * n for c, n in counts.items()) / sum(counts.values())

        assert lossiness(fast) < lossiness(chosen), (chosen, fast)


@pytest.mark.parametrize("over", ["loopback", "unix-socket"])
async def test_auto_sends_raw_within_the_machine(tmp_path: Path, over: str) -> None:
    # 4 x 1 MiB of float32 and 10 ms of compute: raw does not fit the target, and the
    # controller used to take the lossy encodings it had not tried yet as free.
    from aioparamsync.values.rules import sgd

    sock = str(tmp_path / "node.sock")
    async with Node("127.0.0.1", 0, unix_socket=sock if over == "unix-socket" else None) as node:
        address = f"unix:{sock}" if over == "unix-socket" else node.address
        async with ParameterClient(address, timeout=60) as client:
            names = [f"w{i}" for i in range(4)]
            await client.update_arrays(
                {n: np.zeros(1 << 18, np.float32) for n in names}, rules=sgd()
            )
            rng = np.random.default_rng(0)
            for _ in range(25):
                await asyncio.sleep(0.01)  # (the worker's compute)
                grads = {n: rng.random(1 << 18, np.float32) for n in names}
                await client.push_gradients(grads, encoding="auto")
                read = await client.get_parameters(names, encoding="auto")
                assert not any(p.encoding for p in read.params)
            stats = client.stats()
    assert stats["auto"]["counts"] == {"none": 25} and stats["auto"]["local"], stats["auto"]
    assert set(stats["auto_pull"]["counts"]) == {"none"}  # (the first read: sizes not known)


async def test_a_proxy_on_loopback_is_no_local_link(node: Node) -> None:
    from aioparamsync.client.auto import local_link

    async with ParameterClient(node.address) as client:
        assert await local_link(client)
    async with (
        throttle.Throttle(node.address, mbit=0, rtt_ms=0) as link,
        ParameterClient(link.address) as client,
    ):
        assert not await local_link(client)  # (its address is no member's)


async def test_auto_refuses_what_it_cannot_weigh(client: ParameterClient) -> None:
    await client.update_arrays({"w": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match="target is a share"):
        await client.push_gradients({"w": np.ones(4, np.float32)}, encoding="auto", target=0)
    with pytest.raises(ValueError, match="needs the names"):
        await client.get_arrays(None, encoding="auto")
    np.testing.assert_array_equal((await client.get_arrays(["w"]))["w"], np.zeros(4))
    # A pull with "auto" before any read of the name: raw.
    got = await client.get_parameters(["w"], encoding="auto")
    assert not got.params[0].encoding


# -- staleness="auto" through a node ------------------------------------------------------


async def test_stale_sync_lets_a_fast_worker_run_ahead_of_a_straggler(node: Node) -> None:
    from aioparamsync import StaleSync, sum_rule

    steps = 16
    async with ParameterClient(node.address) as fast, ParameterClient(node.address) as slow:
        await fast.update_arrays({"w": np.zeros(4, np.float32)}, rules=sum_rule())
        auto = StaleSync(fast, ["w"], 2, staleness="auto", initial=0, window=3, high=6)
        fixed = StaleSync(slow, ["w"], 2, staleness=0)

        async def work(sync: StaleSync, client: ParameterClient, pause: float) -> list[int]:
            behind = []  # how many pushes each read had beyond what its bound asked
            for step in range(steps):
                least = 2 * (step - sync.bound)
                await sync.pull(step)
                behind.append((await client.get_parameters(["w"])).params[0].version - least)
                await asyncio.sleep(pause)
                await client.push_gradients({"w": np.ones(4, np.float32)})
                sync.done()
            return behind

        seen, _ = await asyncio.gather(work(auto, fast, 0.0), work(fixed, slow, 0.03))
    # Every read at bound 0 waited for the straggler: the bound grew, a step per window.
    assert auto.bound > 0 and fixed.bound == 0
    assert all(why == "reads waited for stragglers" for _, _, why in auto.stats()["changes"])
    # And each read honoured the bound it had: at least 2 x (step - bound) pushes in.
    assert min(seen) >= 0, seen


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"world_size": 0}, ValueError, "world_size"),
        ({"world_size": True}, ValueError, "world_size"),
        ({"staleness": -1}, ValueError, "staleness is a number"),
        ({"staleness": "fast"}, ValueError, "staleness is a number"),
        ({"staleness": 2, "window": 3}, ValueError, "only for staleness='auto'"),
        ({"staleness": "auto", "initial": 9, "high": 4}, ValueError, "staleness needs"),
        ({"names": "w"}, TypeError, "not one string"),
    ],
)
def test_stale_sync_refuses_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    from aioparamsync import StaleSync

    args = {"names": ["w"], "world_size": 2} | kwargs
    with pytest.raises(error, match=match):
        StaleSync(None, args.pop("names"), args.pop("world_size"), **args)
