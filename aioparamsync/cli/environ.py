"""``aioparamsync-node``'s flags from the environment: ``AIOPARAMSYNC_<FLAG>``.

Every flag of the node has a variable (``--data-dir``: ``AIOPARAMSYNC_DATA_DIR``);
a flag given on the command line wins over it. A value is checked as its
flag's would be, and a bad one is refused naming its variable.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

from ..client.environment import ENV_PREFIX, switch

__all__ = ["env_name", "from_environment"]


def env_name(flag: str) -> str:
    """The environment variable of a flag: ``--data-dir`` -> ``AIOPARAMSYNC_DATA_DIR``."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def from_environment(
    parser: argparse.ArgumentParser, argv: Sequence[str], environ: Mapping[str, str]
) -> list[str]:
    """The flags set in ``environ`` and not in ``argv``, as arguments to put before ``argv``.

    Each value is checked as its flag's would be, and a bad one is refused
    naming its variable (``parser.error``: exit status 2).
    """
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    extra: list[str] = []
    for action in parser._actions:
        flags = [f for f in action.option_strings if f.startswith("--")]
        if not flags or action.dest in ("help", "version"):
            continue
        flag = flags[0]
        name = env_name(flag)
        value = environ.get(name)
        if value is None or any(f in given for f in action.option_strings):
            continue
        if isinstance(action, argparse._StoreTrueAction):
            try:
                if switch(name, value):
                    extra.append(flag)
            except ValueError as exc:
                parser.error(str(exc))
            continue
        try:
            converted = action.type(value) if callable(action.type) else value
        except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
            parser.error(f"{name}={value!r} (for {flag}): {exc}")
        if action.choices is not None and converted not in action.choices:
            choices = ", ".join(map(str, action.choices))
            parser.error(f"{name}={value!r} (for {flag}): one of {choices}")
        extra.append(f"{flag}={value}")
    return extra
