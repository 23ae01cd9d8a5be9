"""Which seeds a session runs, and for how long: the options and their variables.

Theory of operation. ``--chaos-seed S`` (``AIOPARAMSYNC_CHAOS_SEED``) runs seed S alone: the
replay of a failure. ``--chaos-seeds N`` (``AIOPARAMSYNC_CHAOS_SEEDS``) runs N seeds from S on
(S, S+1, ...), or from a seed drawn now (printed) when no S is given: a longer search.
``--chaos-duration D`` (``AIOPARAMSYNC_CHAOS_DURATION``) gives each run D seconds of workload
(the plan depends on it: a replay gives the same D). ``--chaos-log-level L``
(``AIOPARAMSYNC_CHAOS_LOG_LEVEL``) is the nodes' ``--log-level`` (warning unless told; info
for a hunt: a failed run keeps every node's whole log beside its history). Given neither a
seed nor a count, a session runs the fixed seeds CI runs. An option wins over its variable;
a value that is not what it should be stops the session with a message naming it.
"""

from __future__ import annotations

import random
import shlex
from collections.abc import Mapping, Sequence

__all__ = [
    "DEFAULT_DURATION",
    "MAX_DURATION",
    "LOG_LEVELS",
    "MAX_SEEDS",
    "REPORTS",
    "log_level",
    "parse_count",
    "parse_duration",
    "parse_log_level",
    "parse_seed",
    "replay_command",
    "seeds_to_run",
]

DEFAULT_DURATION = 6.0  # seconds of workload a run has unless told
MAX_DURATION = 600.0  # the longest workload one run may be given (seconds)
MAX_SEEDS = 10_000  # the most seeds one session may be asked to run
ENV = {
    "seed": "AIOPARAMSYNC_CHAOS_SEED",
    "seeds": "AIOPARAMSYNC_CHAOS_SEEDS",
    "duration": "AIOPARAMSYNC_CHAOS_DURATION",
    "log_level": "AIOPARAMSYNC_CHAOS_LOG_LEVEL",
}
#: the nodes' log levels (``aioparamsync-node --log-level``), the default first
LOG_LEVELS = ("warning", "info", "debug", "error")
#: one report line per run of this session (conftest prints them at its end)
REPORTS: list[str] = []


def parse_seed(text: str) -> int:
    """A seed: a decimal int >= 0.

    Raises:
        ValueError: anything else (the message shows it).
    """
    try:
        seed = int(text.strip(), 10)
    except ValueError:
        seed = -1
    if seed < 0:
        raise ValueError(f"a seed is a whole number >= 0, not {text!r}")
    return seed


def parse_count(text: str) -> int:
    """A number of seeds: 1 to ``MAX_SEEDS``.

    Raises:
        ValueError: anything else.
    """
    try:
        count = int(text.strip(), 10)
    except ValueError:
        count = 0
    if not 1 <= count <= MAX_SEEDS:
        raise ValueError(f"a number of seeds is a whole number from 1 to {MAX_SEEDS}, not {text!r}")
    return count


def parse_duration(text: str) -> float:
    """A workload's duration: seconds above 0, at most ``MAX_DURATION``.

    Raises:
        ValueError: anything else (NaN and infinity too).
    """
    try:
        seconds = float(text.strip())
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds <= MAX_DURATION:
        raise ValueError(
            f"a duration is seconds above 0 and at most {MAX_DURATION:g}, not {text!r}"
        )
    return seconds


def parse_log_level(text: str) -> str:
    """A node's log level: one of ``LOG_LEVELS``, in any case.

    Raises:
        ValueError: anything else.
    """
    level = text.strip().lower()
    if level not in LOG_LEVELS:
        raise ValueError(f"a log level is one of {', '.join(LOG_LEVELS)}, not {text!r}")
    return level


def log_level(option: str | None, env: Mapping[str, str]) -> str:
    """The nodes' log level: the option's, else its variable's, else warning.

    Raises:
        ValueError: an option or variable that is not a log level (named).
    """
    level = _given(option, env, "log_level", parse_log_level)
    return LOG_LEVELS[0] if level is None else str(level)


def _given(option: str | None, env: Mapping[str, str], what: str, parse: object) -> object:
    """The option's value, else its variable's (parsed, named in the error), else None."""
    if option is not None:
        return parse(option)  # type: ignore[operator]
    text = env.get(ENV[what])
    if text is None:
        return None
    try:
        return parse(text)  # type: ignore[operator]
    except ValueError as exc:
        raise ValueError(f"{ENV[what]}: {exc}") from None


def seeds_to_run(
    seed: str | None,
    seeds: str | None,
    duration: str | None,
    env: Mapping[str, str],
    fixed: Sequence[int],
) -> tuple[list[int], float]:
    """The seeds to run and each run's duration (see the module); ``fixed``: CI's seeds.

    Raises:
        ValueError: an option or variable that is not what it should be (named).
    """
    first = _given(seed, env, "seed", parse_seed)
    count = _given(seeds, env, "seeds", parse_count)
    seconds = _given(duration, env, "duration", parse_duration)
    seconds = DEFAULT_DURATION if seconds is None else seconds
    assert isinstance(seconds, float)
    if first is None and count is None:
        return list(fixed), seconds
    if first is None:
        first = random.SystemRandom().randrange(1 << 31)
        print(f"chaos: seeds from {first} on (drawn now)")
    assert isinstance(first, int)
    return list(range(first, first + (count if isinstance(count, int) else 1))), seconds


def replay_command(seed: int, duration: float, env: Mapping[str, str]) -> str:
    """The command that runs ``seed`` again as it ran (its duration; the pure-Python path
    if that is what ran)."""
    prefix = "AIOPARAMSYNC_NO_EXT=1 " if env.get("AIOPARAMSYNC_NO_EXT") else ""
    args = ["tests/test_randomized_cluster.py", "--chaos-seed", str(seed)]
    if duration != DEFAULT_DURATION:
        args += ["--chaos-duration", repr(duration)]
    return f"{prefix}python -m pytest {shlex.join(args)}"
