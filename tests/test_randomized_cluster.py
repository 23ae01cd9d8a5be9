"""Randomized cluster runs: seeded concurrent clients, a nemesis, a checker (``tests/chaos/``).

Each test is one seed: its plan (the cluster, the clients' operations, the faults) is drawn
from the seed alone and printed; real node processes (and etcd, where the plan has a
coordinator) run it on loopback; the checker reads the history and every replica after the
heal (see ``tests/chaos/checker.py`` for what must hold, and the gaps the README documents).
A failure shows the seed, one line of what the run did, the violations, the end of each
node's log, and the command that runs that seed again.

A session runs the fixed seeds below (about 3 minutes on 2 cores), or the seeds the options
say (``--chaos-seed S``, ``--chaos-seeds N``, ``--chaos-duration D``, ``--chaos-log-level
L``; see
``tests/chaos/options.py``). They are marked ``chaos``: ``-m "not chaos"`` leaves them out.
The nodes run in their own processes; this test's loop runs the clients and the proxies, so
it runs on one loop (asyncio's own).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from chaos import options
from chaos.run import SETTLE_TIMEOUT, SETUP_TIMEOUT, run_seed

# The seeds CI runs (about 11 s each here): together they cover each routing mode, --acks 1
# and all, N 3 to 5, R 1 to 3, every rule, every fault under each --acks and under a
# coordinator (tests/test_chaos_harness.py checks that they do); 49 is writers pinned to
# every node under --acks all with no fault, 245 and 160 a kill and a cut with a coordinator;
# 350016 a node of R=1 restarted from its data directory after its keys were written anew
# elsewhere, 410065 one restarted and another drained as it joins (each lost acknowledged
# writes once).
CI_SEEDS = (49, 127, 45, 197, 93, 107, 153, 3, 128, 245, 160, 350016, 410065)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "chaos_seed" not in metafunc.fixturenames:
        return
    config = metafunc.config
    try:
        seeds, duration = options.seeds_to_run(
            config.getoption("--chaos-seed"),
            config.getoption("--chaos-seeds"),
            config.getoption("--chaos-duration"),
            os.environ,
            CI_SEEDS,
        )
        options.log_level(config.getoption("--chaos-log-level"), os.environ)  # (checked)
    except ValueError as exc:
        raise pytest.UsageError(f"chaos: {exc}") from None
    # (each run's bound: the setup, the workload, the heal's settling, and the ops' tail)
    bound = pytest.mark.timeout(SETUP_TIMEOUT + duration + 3 * SETTLE_TIMEOUT + 120)
    params = [pytest.param(s, marks=bound, id=f"seed{s}") for s in seeds]
    metafunc.parametrize("chaos_seed", params)
    metafunc.parametrize("chaos_duration", [duration], ids=[f"{duration:g}s"])


@pytest.mark.chaos
@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_randomized_run_violates_nothing(
    chaos_seed: int, chaos_duration: float, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    level = options.log_level(request.config.getoption("--chaos-log-level"), os.environ)
    result = await run_seed(chaos_seed, chaos_duration, tmp_path, log_level=level)
    report = result.report()
    options.REPORTS.append(report)
    print(report)
    if result.violations:
        result.history.dump(tmp_path / "history.json")
        shown = "\n".join(f"  - {v}" for v in result.violations)
        verdict = f"{report}\n{result.plan.summary()}\nviolations:\n{shown}\n"
        (tmp_path / "violations.txt").write_text(verdict)  # (kept with the history)
        pytest.fail(
            f"{verdict}history: {tmp_path / 'history.json'}, violations: "
            f"{tmp_path / 'violations.txt'}, the nodes' logs: {tmp_path / 'node-*.log'} "
            f"(pytest's --basetemp DIR keeps them)\n"
            f"replay: {options.replay_command(chaos_seed, chaos_duration, os.environ)}",
            pytrace=False,
        )
