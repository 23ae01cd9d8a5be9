"""The randomized runs' own parts (``tests/chaos/``): the generator, the checker, the options.

The checker is given small histories made by hand, each with one thing wrong (an
acknowledged fold lost, one folded twice, a refused push applied, a hang, an error with no
fault near, a write lost, a torn value, a read of the future, a barrier passed early), and
must name it; and the same history inside a fault's documented gap must pass. The generator
must be a function of its seed, bounded, and the seeds CI runs must cover everything it can
draw. The options must refuse what is not a seed, a count or a duration, naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from chaos import options
from chaos.checker import LINK_BACKOFF, Final, check, folds_of, uniform
from chaos.history import Fault, History, Op, merge_outcomes, outcome_of
from chaos.plan import ClientPlan, Key, Plan, TableSpec, make_plan
from test_randomized_cluster import CI_SEEDS

from aioparamsync import CallTimeout, ConnectionLostError, ErrorCode, Indeterminate, RequestError

ROOT = Path(__file__).resolve().parent.parent
SEEDS = range(200)  # plans drawn to see what the generator makes (25 ms each)


@functools.cache
def _drawn(seed: int, duration: float = options.DEFAULT_DURATION) -> Plan:
    return make_plan(seed, duration)


# -- the generator ------------------------------------------------------------------------


def test_a_plan_is_a_function_of_its_seed_and_duration() -> None:
    assert make_plan(7, 6.0) == make_plan(7, 6.0)
    assert make_plan(7, 6.0).summary() == make_plan(7, 6.0).summary()
    assert make_plan(7, 6.0) != make_plan(8, 6.0)
    assert make_plan(7, 6.0) != make_plan(7, 9.0)
    assert len({make_plan(s, 6.0).summary() for s in range(50)}) == 50


@pytest.mark.parametrize(("duration", "seeds"), [(6.0, SEEDS), (30.0, range(20))])
def test_every_plan_is_bounded(duration: float, seeds: range) -> None:
    for seed in seeds:
        plan = _drawn(seed, duration)
        assert 3 <= plan.nodes <= 5 and 1 <= plan.replication <= 3, plan.summary()
        assert plan.acks in ("1", "all") and 2 <= len(plan.clients) <= 4
        assert len(plan.events) <= 3
        ends = [e.at + e.hold for e in plan.events]
        assert all(end <= duration - 0.5 for end in ends), plan.summary()
        assert all(a.at + a.hold < b.at for a, b in itertools.pairwise(plan.events)), (
            f"faults overlap: {plan.summary()}"
        )
        members = plan.nodes + sum(1 for e in plan.events if e.kind == "join")
        members -= sum(1 for e in plan.events if e.kind == "drain")
        assert members >= 2 and (members >= plan.replication or plan.replication > plan.nodes)
        assert plan.proxies == any(e.kind in ("cut", "delay") for e in plan.events)
        assert plan.data_dir or not any(e.kind == "kill" for e in plan.events)
        assert plan.coordinator or not any(e.kind == "etcd" for e in plan.events)
        ops = [op for c in plan.clients for lane in c.lanes for op in lane]
        ids = [r for op in ops for r in op.request_ids]
        stamps = [op.stamp for op in ops if op.kind == "update"]
        assert len(set(ids)) == len(ids) and len(set(stamps)) == len(stamps)
        assert 0 not in stamps and max(stamps, default=0) < 1 << 24  # (exact in float32)


@pytest.mark.parametrize(
    ("seed", "duration"),
    [(-1, 6.0), (1.5, 6.0), ("1", 6.0), (True, 6.0), (1, 0), (1, -2.0), (1, float("nan")),
     (1, float("inf")), (1, "6")],
)  # fmt: skip
def test_a_plan_refuses_what_is_not_a_seed_or_a_duration(seed: object, duration: object) -> None:
    with pytest.raises(ValueError, match=r"seed|duration"):
        make_plan(seed, duration)  # type: ignore[arg-type]


def test_the_ci_seeds_cover_everything_the_generator_draws() -> None:
    everything = set().union(*(_drawn(s).features() for s in SEEDS))
    covered = set().union(*(_drawn(s).features() for s in CI_SEEDS))
    assert everything - covered == set(), f"CI's seeds {CI_SEEDS} miss these"


# -- the history ----------------------------------------------------------------------------


def test_outcomes_say_what_is_known_of_a_call() -> None:
    refused = RequestError(ErrorCode.UNAVAILABLE, "no")
    assert outcome_of(refused, 1)[0] == "failed"
    # (applied by the node, not confirmed by a replica: it may stay or be lost)
    assert outcome_of(Indeterminate("applied by n0, but ..."), 1)[0] == "indeterminate"
    assert outcome_of(refused, 2)[0] == "indeterminate"  # (another part may be folded)
    assert outcome_of(CallTimeout("late"), 1)[0] == "indeterminate"
    assert outcome_of(ConnectionLostError("gone"), 1)[0] == "indeterminate"
    with pytest.raises(KeyError):
        outcome_of(KeyError("a bug of the harness"), 1)
    assert merge_outcomes(["indeterminate", "ok"]) == "ok"
    assert merge_outcomes(["failed", "failed"]) == "failed"
    assert merge_outcomes(["indeterminate", "failed"]) == "indeterminate"
    assert merge_outcomes(["indeterminate", "hung"]) == "hung"


# -- the checker ----------------------------------------------------------------------------


def _plan(**changes: object) -> Plan:
    plan = Plan(
        seed=0,
        duration=10.0,
        nodes=3,
        replication=2,
        acks="all",
        coordinator=False,
        data_dir=False,
        failure_timeout=2.0,
        keys=(Key("g0", "sum", 4), Key("g1", "sgd", 4), Key("g2", "adam", 4), Key("u0", None, 4)),
        table=TableSpec("emb", "sgd", dim=2, buckets=4, ids=8),
        clients=(ClientPlan("c0", 0, ()), ClientPlan("c1", None, ())),
        events=(),
        barriers=False,
    )
    return dataclasses.replace(plan, **changes)


def _op(kind: str, at: float, outcome: str = "ok", **fields: object) -> Op:
    fields.setdefault("complete", at + 0.1)
    return Op(
        index=0, client="c0", lane=0, kind=kind, target="n0", invoke=at, outcome=outcome,
        **fields,  # type: ignore[arg-type]
    )  # fmt: skip


def _bytes(value: float) -> bytes:
    return np.full(4, value, np.float32).tobytes()


def _final(folds: int = 2, stamp: float = 2.0, rows: int = 1, **params: bytes) -> Final:
    """The state after two pushes of g0..g2, the write stamped 2 of u0, one push of row 3."""
    held = {
        "g0": _bytes(folds),
        "g1": _bytes(-0.5 * folds),
        "g2": _bytes(-folds),
        "u0": _bytes(stamp),
    }
    held |= params
    return Final(
        params={n: (1 + folds, "n0", b) for n, b in held.items()},
        rows={3: (rows, (-0.5 * rows,) * 2)} if rows else {},
    )  # fmt: skip


def _history(*more: Op) -> History:
    g = ("g0", "g1", "g2")
    ops = [
        _op("push", 1.0, keys=g, request_id="a"),
        _op("push", 1.0, keys=g, request_id="b"),
        _op("update", 1.5, keys=("u0",), stamp=1, versions={"u0": 2}),
        _op("update", 2.0, keys=("u0",), stamp=2, versions={"u0": 3}),
        _op("row_push", 2.0, ids=(3,), request_id="r"),
        *more,
    ]
    for i, op in enumerate(ops):
        op.index = i
    return History(ops=ops)


def _violations(plan: Plan, history: History, final: Final) -> str:
    return "\n".join(check(plan, history, final))


def test_a_run_as_it_should_be_passes() -> None:
    assert check(_plan(), _history(), _final()) == []
    assert uniform([1.0, 1.0]) == 1.0 and uniform([1.0, 2.0]) is None
    assert folds_of("sgd", -1.5) == (3, True) and folds_of("adam", -2.9999) == (3, True)
    assert folds_of("sum", 2.5)[1] is False


def test_an_acknowledged_fold_lost_or_one_folded_twice_is_named() -> None:
    lost = _violations(_plan(), _history(), _final(folds=1))
    assert "'g0' (sum)" in lost and "1 acknowledged lost" in lost
    assert "'g1' (sgd)" in lost and "'g2' (adam)" in lost
    twice = _violations(_plan(), _history(), _final(folds=3))
    assert "'g0' (sum)" in twice and "1 more than pushed" in twice
    # A push of unknown outcome (in a fault: see below) may be folded, or not: both pass.
    unknown = _history(_op("push", 3.0, "indeterminate", keys=("g0", "g1", "g2")))
    unknown.faults.append(Fault("delay", ("n0",), 2.9, 3.2))
    assert check(_plan(), unknown, _final(folds=2)) == []
    assert check(_plan(), unknown, _final(folds=3)) == []


def test_a_refused_push_that_was_applied_is_named() -> None:
    refused = _op("push", 3.0, "failed", keys=("g0",), error="RequestError: no")
    found = _violations(_plan(), _history(refused), _final(g0=_bytes(3)))
    assert "'g0' (sum) v3 from n0 holds 3 folds: 1 more than pushed" in found


def test_a_hang_and_an_error_with_no_fault_near_are_named() -> None:
    hung = _op("push", 3.0, "hung", keys=("g0",), error="no answer within 8 s")
    assert "#5 push[g0] by c0@n0 at 3.00s hung: no answer within 8 s" in _violations(
        _plan(), _history(hung), _final()
    )
    error = _op("push", 3.0, "failed", keys=("g0",), error="RequestError: UNKNOWN_PARAMETER")
    found = _violations(_plan(), _history(error), _final())
    assert "#5 push[g0] by c0@n0 at 3.00s failed with no fault near: RequestError" in found
    # The same error within a fault's window (its heal plus the grace) is no violation.
    history = _history(error)
    history.faults.append(Fault("kill", ("n1",), 1.0, 3.0 - 2.0 - LINK_BACKOFF + 0.5))
    assert check(_plan(), history, _final()) == []
    # ... nor an op sent to a node after it was drained.
    history = _history(error)
    history.faults.append(Fault("drain", ("n0",), 0.0, 0.1))
    assert check(_plan(), history, _final()) == []


def test_a_lost_acknowledged_fold_inside_a_documented_gap_passes() -> None:
    kill = Fault("kill", ("n1",), 0.5, 1.5)
    history = _history()
    history.faults.append(kill)
    assert check(_plan(), history, _final(folds=1)) == []  # (no coordinator: a gap)
    coordinated = _violations(_plan(coordinator=True), history, _final(folds=1))
    assert "1 acknowledged lost" in coordinated  # (a coordinator promises it)
    history.faults[0] = Fault("delay", ("n1",), 0.5, 1.5)  # (a delay loses nothing)
    assert "1 acknowledged lost" in _violations(_plan(), history, _final(folds=1))


def test_a_lost_acknowledged_write_is_named_with_acks_all() -> None:
    # u0 holds stamp 1, whose write was acknowledged before the write of stamp 2 began.
    found = _violations(_plan(), _history(), _final(stamp=1.0))
    assert "'u0' v3 from n0: acknowledged #3 update[u0]" in found and "lost" in found
    assert check(_plan(acks="1"), _history(), _final(stamp=1.0)) == []  # (see the checker)
    assert "which no write of it had" in _violations(_plan(), _history(), _final(stamp=7.0))
    torn = np.array([2, 2, 2, 1], np.float32).tobytes()
    assert "elements differ" in _violations(_plan(), _history(), _final(u0=torn))
    refused = _history(_op("update", 3.0, "failed", keys=("u0",), stamp=9))
    assert "which was refused" in _violations(_plan(), refused, _final(stamp=9.0))


def test_rows_lost_or_folded_twice_are_named() -> None:
    assert "row 3 of 'emb' (sgd) v0: 1 acknowledged folds lost" in _violations(
        _plan(), _history(), _final(rows=0)
    )
    assert "row 3 of 'emb' (sgd) v2: 1 folds more than pushed" in _violations(
        _plan(), _history(), _final(rows=2)
    )
    wrong = _final()
    wrong.rows[3] = (1, (-1.0, -1.0))  # (one fold, the value of two)
    assert "not its 1 folds" in _violations(_plan(), _history(), wrong)


def test_reads_of_what_was_never_written_or_not_yet_are_named() -> None:
    future = _op("read", 1.0, keys=("u0",), seen={"u0": (3, 2.0)}, complete=1.2)
    assert "the write of #3 update[u0]" in _violations(_plan(), _history(future), _final())
    below = _op("read", 3.0, keys=("u0",), min_version=3, seen={"u0": (2, 1.0)})
    assert "below its min_version 3" in _violations(_plan(), _history(below), _final())
    rows = _op("row_pull", 1.0, ids=(3,), seen={"3": (0, -0.5)})
    assert "1 folds, 0 pushed by then" in _violations(_plan(), _history(rows), _final())
    # A pull may see a push folded twice where a gap allows it (as the final rows may).
    twice = _op("row_pull", 2.5, ids=(3,), seen={"3": (0, -1.0)})
    assert "2 folds, 1 pushed by then" in _violations(_plan(), _history(twice), _final(rows=2))
    killed = _history(twice)
    killed.faults.append(Fault("kill", ("n1",), 1.9, 2.2))
    assert check(_plan(), killed, _final(rows=2)) == []


def test_a_barrier_passed_before_every_worker_came_is_named() -> None:
    early = _op("barrier", 3.0, step=1)
    assert "passed step 1 when 1 of 2 workers had come" in _violations(
        _plan(), _history(early), _final()
    )
    other = dataclasses.replace(_op("barrier", 3.05, step=1), client="c1")
    assert check(_plan(), _history(early, other), _final()) == []


def test_what_the_heal_found_is_a_violation() -> None:
    final = _final()
    final.problems.append("'g0': replicas differ")
    assert check(_plan(), _history(), final) == ["'g0': replicas differ"]


# -- the options ----------------------------------------------------------------------------


def test_the_options_choose_the_seeds_and_the_duration() -> None:
    fixed = (4, 5)
    assert options.seeds_to_run(None, None, None, {}, fixed) == ([4, 5], 6.0)
    assert options.seeds_to_run("12", None, "2.5", {}, fixed) == ([12], 2.5)
    assert options.seeds_to_run("12", "3", None, {}, fixed) == ([12, 13, 14], 6.0)
    env = {"AIOPARAMSYNC_CHAOS_SEED": "7", "AIOPARAMSYNC_CHAOS_DURATION": "9"}
    assert options.seeds_to_run(None, None, None, env, fixed) == ([7], 9.0)
    assert options.seeds_to_run("8", None, "1", env, fixed) == ([8], 1.0)  # (options win)
    drawn, _ = options.seeds_to_run(None, "2", None, {}, fixed)
    assert len(drawn) == 2 and drawn[1] == drawn[0] + 1


@pytest.mark.parametrize(
    ("seed", "seeds", "duration", "env", "message"),
    [
        ("x", None, None, {}, "a seed is a whole number >= 0, not 'x'"),
        ("-3", None, None, {}, "not '-3'"),
        (None, "0", None, {}, "a number of seeds is a whole number from 1"),
        (None, "lots", None, {}, "not 'lots'"),
        (None, None, "0", {}, "a duration is seconds above 0"),
        (None, None, "nan", {}, "not 'nan'"),
        (None, None, "1e9", {}, "at most 600"),
        (None, None, None, {"AIOPARAMSYNC_CHAOS_SEED": "1.5"}, "AIOPARAMSYNC_CHAOS_SEED: a seed"),
        (None, None, None, {"AIOPARAMSYNC_CHAOS_SEEDS": ""}, "AIOPARAMSYNC_CHAOS_SEEDS: a num"),
        (None, None, None, {"AIOPARAMSYNC_CHAOS_DURATION": "-1"}, "AIOPARAMSYNC_CHAOS_DURATION"),
    ],
)
def test_the_options_refuse_what_is_not_a_seed_a_count_or_a_duration(
    seed: str | None, seeds: str | None, duration: str | None, env: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        options.seeds_to_run(seed, seeds, duration, env, (1,))


def test_the_nodes_log_level_is_the_options_else_its_variables_else_warning() -> None:
    assert options.log_level(None, {}) == "warning"
    assert options.log_level("INFO", {}) == "info"
    env = {"AIOPARAMSYNC_CHAOS_LOG_LEVEL": " debug "}
    assert options.log_level(None, env) == "debug"
    assert options.log_level("error", env) == "error"  # (the option wins)
    with pytest.raises(ValueError, match="a log level is one of warning, info, debug, error"):
        options.log_level("loud", {})
    with pytest.raises(ValueError, match="AIOPARAMSYNC_CHAOS_LOG_LEVEL: a log level"):
        options.log_level(None, {"AIOPARAMSYNC_CHAOS_LOG_LEVEL": ""})


@pytest.mark.chaos
@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_failed_run_keeps_every_nodes_whole_log_at_the_level_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real node processes, a short run of CI's first seed, judged failed here: every
    node's log (at info) is kept in the run's directory, one file a node process."""
    from chaos import run as chaos_run

    monkeypatch.setattr(chaos_run, "check", lambda plan, history, final: ["judged failed"])
    result = await chaos_run.run_seed(CI_SEEDS[0], 0.5, tmp_path, log_level="info")
    assert result.violations == ["judged failed"]
    logs = _kept_logs(tmp_path)
    assert len(logs) >= result.plan.nodes, list(logs)
    for path, text in logs.items():
        assert " INFO aioparamsync." in text, path


def _kept_logs(directory: Path) -> dict[str, str]:
    """The nodes' logs a run kept in ``directory``, by file name."""
    return {p.name: p.read_text() for p in sorted(directory.glob("node-*.log"))}


def test_the_replay_command_names_the_seed_and_a_duration_not_the_default() -> None:
    assert options.replay_command(12, 6.0, {}) == (
        "python -m pytest tests/test_randomized_cluster.py --chaos-seed 12"
    )
    command = options.replay_command(12, 6.123456789, {"AIOPARAMSYNC_NO_EXT": "1"})
    assert command.startswith("AIOPARAMSYNC_NO_EXT=1 python -m pytest")
    assert command.endswith("--chaos-seed 12 --chaos-duration 6.123456789")


def _collect(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """``pytest --collect-only`` of the randomized runs, with ``args`` (and ``env``)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("AIOPARAMSYNC_CHAOS")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/test_randomized_cluster.py", "--collect-only",
         "-q", "-p", "no:cacheprovider", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**environ, **(env or {})},
        cwd=ROOT,
        check=False,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def test_a_session_collects_the_seeds_it_is_told() -> None:
    rc, out = _collect("--chaos-seed", "10", "--chaos-seeds", "3")
    assert rc == 0, out
    assert [f"seed{s}" in out for s in (10, 11, 12)] == [True] * 3 and "seed13" not in out
    rc, out = _collect()
    assert rc == 0 and all(f"[seed{s}-6s]" in out for s in CI_SEEDS), out


def test_a_session_told_a_bad_seed_or_duration_stops_naming_it() -> None:
    rc, out = _collect("--chaos-seed", "abc")
    assert rc != 0 and "chaos: a seed is a whole number >= 0, not 'abc'" in out, out
    rc, out = _collect(env={"AIOPARAMSYNC_CHAOS_DURATION": "forever"})
    assert rc != 0 and "AIOPARAMSYNC_CHAOS_DURATION: a duration is seconds" in out, out
    rc, out = _collect("--chaos-log-level", "loud")
    assert rc != 0 and "chaos: a log level is one of warning, info" in out, out
