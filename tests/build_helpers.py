"""Test helpers: the Dockerfile's instructions, the build context .dockerignore admits, wheels.

The context is chosen by the .dockerignore's own rules, read as Docker reads them
(moby's patternmatcher): a pattern per line, ``*`` and ``?`` within a path's part,
``**`` across parts, ``!`` an exception; a path is left out when the last pattern that
matches it or one of its parent directories is not an exception.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
# A wheel build with the compile (the image's): minutes on two busy cores, bounded.
BUILD_TIMEOUT = 900


def dockerfile(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """The Dockerfile's instructions, (INSTRUCTION, arguments), continuation lines joined."""
    instructions, pending = [], ""
    for line in path.read_text().splitlines():
        text = line.strip()
        if not pending and (not text or text.startswith("#")):
            continue
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        word, _, rest = (pending + text).partition(" ")
        instructions.append((word.upper(), rest.strip()))
        pending = ""
    return instructions


@dataclass(frozen=True)
class Rule:
    """One line of a .dockerignore: a pattern, and whether it is an exception (``!``)."""

    pattern: str
    regex: re.Pattern[str]
    exception: bool

    def matches(self, path: str) -> bool:
        """The pattern matches ``path`` or one of its parent directories."""
        parts = path.split("/")
        return any(self.regex.fullmatch("/".join(parts[:i])) for i in range(len(parts), 0, -1))


def _regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regular expression (patternmatcher's translation)."""
    out, i = "", 0
    while i < len(pattern):
        ch = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                i += 1
            out += ".*" if i >= len(pattern) else "(.*/)?"
            continue
        if ch == "*":
            out += "[^/]*"
        elif ch == "?":
            out += "[^/]"
        elif ch == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        elif ch == "[" and "]" in pattern[i:]:  # (a class of characters, as it is)
            end = pattern.index("]", i)
            out += pattern[i : end + 1]
            i = end
        else:
            out += re.escape(ch)
        i += 1
    return re.compile(out)


def dockerignore(path: Path = DOCKERIGNORE) -> list[Rule]:
    """The rules of a .dockerignore, in order."""
    rules = []
    for line in path.read_text().splitlines():
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        exception = text.startswith("!")
        pattern = os.path.normpath(text.removeprefix("!").strip()).lstrip("/")
        rules.append(Rule(pattern, _regex(pattern), exception))
    return rules


def admitted(path: str, rules: list[Rule]) -> bool:
    """Whether the file ``path`` (relative to the context, with /) is in the build context."""
    excluded = False
    for rule in rules:
        if rule.matches(path):
            excluded = not rule.exception
    return not excluded


def _may_admit_below(directory: str, rules: list[Rule]) -> bool:
    """Whether an exception could admit a file under a directory the rules leave out."""
    for rule in rules:
        if not rule.exception:
            continue
        literal = re.split(r"[*?\[\\]", rule.pattern)[0]
        if literal.startswith(directory + "/") or directory.startswith(literal) or not literal:
            return True
    return False


def context_files(root: Path = ROOT, rules: list[Rule] | None = None) -> list[str]:
    """The files of ``root`` that its .dockerignore admits (relative paths, with /)."""
    rules = dockerignore(root / ".dockerignore") if rules is None else rules
    found = []
    for top, dirs, files in os.walk(root):
        here = Path(top).relative_to(root).as_posix()
        prefix = "" if here == "." else here + "/"
        dirs[:] = [
            d for d in dirs if admitted(prefix + d, rules) or _may_admit_below(prefix + d, rules)
        ]
        found += [prefix + f for f in files if admitted(prefix + f, rules)]
    return sorted(found)


def copy_context(destination: Path, root: Path = ROOT) -> list[str]:
    """Copy the build context of ``root`` to ``destination``; returns the files copied."""
    files = context_files(root)
    for name in files:
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target)
    return files


@dataclass(frozen=True)
class WheelCommand:
    """The build stage's ``pip wheel`` RUN: the shell command, where it mounts the context,
    and where it puts the wheel."""

    command: str
    context: str
    wheels: str

    def run(self, context: Path, wheels: Path, **env: str) -> subprocess.CompletedProcess[str]:
        """Run the command on ``context``, the wheel into ``wheels``, with this venv's pip.

        The environment is this one's, less the AIOPARAMSYNC_* variables, plus ``env``.
        """
        command = self.command
        for inside, outside in ((self.context, context), (self.wheels, wheels)):
            command = re.sub(rf"(?<![\w/.]){re.escape(inside)}(?![\w/.])", str(outside), command)
        environ = {k: v for k, v in os.environ.items() if not k.startswith("AIOPARAMSYNC_")}
        environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{environ.get('PATH', '')}"
        return subprocess.run(
            ["sh", "-c", command],
            env={**environ, **env},
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT,
        )


def wheel_command(path: Path = DOCKERFILE) -> WheelCommand:
    """The ``pip wheel`` RUN of the Dockerfile's build stage, read from it."""
    (run,) = [rest for word, rest in dockerfile(path) if word == "RUN" and "pip wheel" in rest]
    words = shlex.split(run)
    mounts = [w.removeprefix("--mount=") for w in words if w.startswith("--mount=")]
    (mount,) = [m for m in mounts if "type=bind" in m]
    options = dict(o.partition("=")[::2] for o in mount.split(","))
    assert options.get("source") == ".", f"the wheel's RUN mounts {options}, not the context"
    command = run
    while command.startswith("--"):
        command = command.partition(" ")[2].lstrip()
    tokens = shlex.split(command)
    wheels = tokens[tokens.index("-w") + 1]
    return WheelCommand(command, options["target"], wheels)
