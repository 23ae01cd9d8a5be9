"""README.md and the pages of docs/ say what is true: each Python snippet runs as
written, each command names flags, subcommands, files, extras and tox environments
that exist.

The Python snippets run in order (the README's, then each page's, by name), each in
a fresh ``python`` process (this interpreter) against one real node process on
127.0.0.1 and a port the kernel picks, the pages' ``127.0.0.1:9090`` rewritten to
that node's address; each runs twice, as a user who pastes it again does (the
second time the node already holds what the first run stored). A snippet may opt
out with a line ``# not run: <why>``; one that imports torch is skipped when torch
is not installed. Every fenced block says its language, and Python is ``python``:
a block under another name would escape the run.

The commands are read from the ``bash`` blocks and from inline code that starts
with a program's name; a bare ``--flag`` in the text is the node's (the pages
speak of the node's flags so), but on the command-line page, which
tests/test_docs.py checks flag by flag. Each flag is checked against the
program's own ``--help``. Every process is bounded in time, and the node is killed
(by PID) at the end whatever happens.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
from cluster_helpers import LISTENING, NODE_COMMAND, START_TIMEOUT

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# The pages whose snippets run and whose commands are checked, in the order they run.
PAGES = [README, *sorted(DOCS.glob("*.md"))]
# The page that lists every flag of both programs (checked by tests/test_docs.py).
CLI_PAGE = DOCS / "cli.md"
# Files that tell users how to install: none may name the package as if on an index.
INSTALL_DOCS = [*PAGES, ROOT / "benchmarks" / "README.md", *sorted((ROOT / "examples").iterdir())]
# The address the snippets use: a node started with no flags listens there.
DEFAULT_ADDRESS = "127.0.0.1:9090"
# A line that keeps a snippet from running, with the reason after the colon.
NOT_RUN = re.compile(r"^\s*# not run: *(?P<why>.*)$", re.MULTILINE)
# Bounds (seconds): one run of a snippet (torch's import alone takes seconds on a
# loaded machine), and one ``--help``.
SNIPPET_TIMEOUT = 120.0
HELP_TIMEOUT = 60.0
EXIT_TIMEOUT = 10.0
# The console scripts, installed beside this interpreter.
BIN = Path(sys.executable).parent
NODE, CTL = "aioparamsync-node", "aioparamsync-ctl"

pytestmark = pytest.mark.timeout(2 * SNIPPET_TIMEOUT + 60)


# -- reading the pages --------------------------------------------------------------------

# A fenced block, at any indent (one in a list item is indented): its language and body.
FENCE = re.compile(
    r"^(?P<indent>[ ]*)```(?P<lang>[\w+-]*)[ ]*\n(?P<body>.*?)^(?P=indent)```[ ]*$",
    re.MULTILINE | re.DOTALL,
)


# The languages a fenced block may say; Python is "python" alone (the one that runs).
LANGUAGES = {"python", "bash", "text"}


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int  # of the opening fence, 1-based
    page: Path = README

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(text: str, page: Path = README) -> list[Block]:
    found = []
    for match in FENCE.finditer(text):
        indent = len(match["indent"])
        lines = [line[indent:] for line in match["body"].splitlines()]
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(match["lang"], "\n".join(lines) + "\n", line, page))
    return found


def prose(text: str) -> str:
    """A page without its fenced blocks."""
    return FENCE.sub("", text)


def code_spans(text: str) -> list[str]:
    """The inline code of the prose, each with its whitespace (line breaks too) made one space."""
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose(text))]


TEXTS = {page: page.read_text(encoding="utf-8") for page in PAGES}
TEXT = TEXTS[README]
BLOCKS = [block for page, text in TEXTS.items() for block in blocks(text, page)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]


# -- the Python snippets -------------------------------------------------------------------


def test_every_page_is_read() -> None:
    # The pages of docs/ are here (a glob that found none would check nothing).
    names = {page.name for page in PAGES}
    assert {"README.md", "index.md", "quickstart.md", "training.md", "cli.md"} <= names, names


def test_every_python_block_is_found() -> None:
    # A fence the pattern missed (a typo in it, an odd indent) would go untested.
    for page, text in TEXTS.items():
        found = [b for b in PYTHON if b.page == page]
        assert len(found) == text.count("```python"), [str(b) for b in found]
        fences = len(re.findall(r"^[ ]*(```|~~~)", text, re.MULTILINE))
        assert fences == 2 * len([b for b in BLOCKS if b.page == page]), f"{page}: a fence missed"
    assert len([b for b in PYTHON if b.page == README]) >= 1  # the first screen's example
    assert len(PYTHON) >= 5  # the client, training with gradients, PyTorch, torch workers


def test_every_block_says_a_language_that_is_checked() -> None:
    # ```py or ```python3 would not run; a block with no language could be Python unseen.
    odd = [f"{b} ({b.lang or 'none'})" for b in BLOCKS if b.lang not in LANGUAGES]
    assert not odd, f"fenced blocks in another language than {sorted(LANGUAGES)}: {odd}"


@pytest.fixture(scope="module")
def node_address() -> Iterator[str]:
    """A node process on 127.0.0.1 and a port the kernel picks: its "host:port"."""
    with tempfile.TemporaryFile("w+b") as log:
        process = subprocess.Popen(
            [*NODE_COMMAND, "--port", "0"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield wait_listening(process, log)
        finally:
            process.terminate()
            try:
                process.wait(timeout=EXIT_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()  # by its PID
                process.wait()


def wait_listening(process: subprocess.Popen[bytes], log) -> str:
    """The address on the node's listening line (bounded wait)."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        log.seek(0)
        output = log.read().decode(errors="replace")
        for line in output.splitlines():
            if match := LISTENING.match(line):
                return f"{match['host']}:{match['port']}"
        if process.poll() is not None:
            raise AssertionError(f"the node exited with {process.returncode}:\n{output}")
        time.sleep(0.02)
    raise AssertionError(f"the node did not listen within {START_TIMEOUT} s")


# A snippet that imports torch, or aioparamsync.torch (which imports it).
TORCH = re.compile(r"^\s*(import torch|from torch|from aioparamsync import torch)", re.MULTILINE)


def needs_torch(code: str) -> bool:
    return bool(TORCH.search(code))


@pytest.mark.parametrize("block", PYTHON, ids=str)
def test_python_snippet_runs_as_written(block: Block, node_address: str, tmp_path: Path) -> None:
    if opt_out := NOT_RUN.search(block.code):
        assert opt_out["why"].strip(), f"{block}: '# not run:' needs a reason"
        pytest.skip(f"{block}: not run: {opt_out['why']}")
    if needs_torch(block.code) and importlib.util.find_spec("torch") is None:
        pytest.skip(f"{block} needs torch (pip install '.[torch]')")
    run_snippet(block, node_address, tmp_path)


def run_snippet(block: Block, node_address: str, tmp_path: Path) -> None:
    """Run the snippet twice against the node; fail with its output if a run fails."""
    script = tmp_path / "snippet.py"
    script.write_text(block.code.replace(DEFAULT_ADDRESS, node_address))
    # One BLAS and torch thread: the machine's cores are shared with the node.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    for attempt in ("first", "second"):
        try:
            result = subprocess.run(
                [sys.executable, str(script)],
                cwd=tmp_path,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=SNIPPET_TIMEOUT,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:  # (run() killed it)
            pytest.fail(f"{block} ran past {SNIPPET_TIMEOUT} s ({attempt} run):\n{exc.stderr}")
        assert result.returncode == 0, (
            f"{block} exited with {result.returncode} ({attempt} run)\n"
            f"--- stdout:\n{result.stdout}\n--- stderr:\n{result.stderr}\n"
            f"--- snippet:\n{block.code}"
        )


def test_a_failing_snippet_fails_the_test(node_address: str, tmp_path: Path) -> None:
    # The check above can fail: a snippet whose call the node refuses exits non-zero.
    code = (
        "import asyncio\nimport numpy as np\nfrom aioparamsync import ParameterClient\n"
        "async def main():\n"
        f"    async with ParameterClient({DEFAULT_ADDRESS!r}) as client:\n"
        "        await client.push_gradients({'no such parameter': np.ones(2)})\n"
        "asyncio.run(main())\n"
    )
    block = Block("python", code, 0)
    with pytest.raises(AssertionError, match=r"(?s)exited with 1 .*UNKNOWN_PARAMETER"):
        run_snippet(block, node_address, tmp_path)


# -- the commands ---------------------------------------------------------------------------

# Programs whose inline code is read as a command.
PROGRAMS = {NODE, CTL, "python", "python3", "pip", "bash", "jupyter", "tox"}
OPERATORS = {"&&", "||", "&", ";", "|"}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def commands_of(line: str, operators: str = "&;|") -> list[list[str]]:
    """The simple commands of one line of shell: its words, comments and operators
    (``&&``, ``&``, ``;``, ``|``: those made of ``operators``) taken out."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=operators)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in OPERATORS:
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def page_commands(page: Path) -> list[list[str]]:
    found = []
    for block in blocks(TEXTS[page], page):
        if block.lang == "bash":
            for line in block.code.replace("\\\n", " ").splitlines():  # (continuations)
                found += commands_of(line)
    for span in code_spans(TEXTS[page]):
        if span.split()[0] in PROGRAMS:
            # In the text, `stats|peers` means "either": not a pipe.
            found += commands_of(span, operators="&;")
    return found


COMMANDS = [argv for page in PAGES for argv in page_commands(page)]


def node_command(argv: list[str]) -> list[str] | None:
    """The arguments after the node's name, if ``argv`` starts the node."""
    if argv[0] == NODE:
        return argv[1:]
    if argv[0].startswith("python") and argv[1:3] == ["-m", "aioparamsync"]:
        return argv[3:]
    return None


@cache
def help_of(*argv: str) -> str:
    """What ``argv --help`` prints (it must succeed)."""
    result = subprocess.run(
        [*argv, "--help"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=HELP_TIMEOUT,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, f"{' '.join(argv)} --help: {result}"
    return result.stdout


def script(name: str) -> str:
    path = BIN / name
    assert path.exists(), f"the console script {name} is not installed beside {sys.executable}"
    return str(path)


def flags(text: str) -> set[str]:
    return set(FLAG.findall(text))


def test_the_pages_name_commands() -> None:
    # What the tests below check is there: they would pass on nothing.
    programs = {argv[0] for argv in COMMANDS}
    assert {NODE, CTL, "bash", "pip"} <= programs, programs
    assert any(argv[:2] == ["bash", ".ci/run"] for argv in COMMANDS)
    assert any(a[0].startswith("python") and "examples/train_async_sgd.py" in a for a in COMMANDS)


def test_the_readme_opens_with_the_install_the_main_job_and_the_tests() -> None:
    # The first screen: its first block installs from the checkout and runs the main job, and
    # runs the tests.
    first = blocks(TEXT)[0]
    assert first.lang == "bash", first
    commands = [argv for line in first.code.splitlines() for argv in commands_of(line)]
    installs = [a for a in commands if a[:4] == ["python3", "-m", "pip", "install"]]
    assert installs and all(a[4:] == ["."] for a in installs), commands
    assert ["python3", "examples/train_async_sgd.py"] in commands, commands
    assert ["bash", ".ci/run"] in commands, commands
    assert TEXT.index("```bash") < TEXT.index("\n## "), "the commands come before any section"


def test_every_node_flag_exists() -> None:
    known = flags(help_of(script(NODE)))
    assert {"--port", "--peers", "--data-dir"} <= known  # the help was read
    mentioned: dict[str, str] = {}
    for argv in COMMANDS:
        rest = node_command(argv)
        if rest is not None:
            mentioned |= {flag: " ".join(argv) for flag in flags(" ".join(rest))}
    for page in PAGES:
        if page == CLI_PAGE:  # (ctl's flags too: tests/test_docs.py checks them by program)
            continue
        for span in code_spans(TEXTS[page]):
            if span.startswith("--"):  # a bare flag: the node's
                mentioned |= {flag: f"{page.name}: {span}" for flag in flags(span)}
    assert len(mentioned) > 10, mentioned
    unknown = {flag: where for flag, where in mentioned.items() if flag not in known}
    assert not unknown, f"flags that aioparamsync-node does not have: {unknown}"


def test_every_ctl_command_and_flag_exists() -> None:
    ctl = script(CTL)
    global_flags = flags(help_of(ctl))
    checked = set()
    for argv in COMMANDS:
        if argv[0] != CTL or argv == [CTL]:  # (`aioparamsync-ctl` alone names the program)
            continue
        words = argv[1:]
        while words and words[0].startswith("-"):
            assert words[0].split("=")[0] in global_flags, f"{words[0]} in {' '.join(argv)}"
            words = words[1:]
        assert words, f"no command in {' '.join(argv)}"
        for command in words[0].split("|"):  # `stats|peers|...`: each of them
            usage = help_of(ctl, command)
            assert f"usage: {CTL} {command}" in usage, usage
            known = flags(usage) | global_flags
            unknown = flags(" ".join(words[1:])) - known
            assert not unknown, f"{' '.join(argv)}: {CTL} {command} has no {unknown}"
            checked.add(command)
    assert {"stats", "peers", "waiting", "ping", "get"} <= checked, checked


def test_a_ctl_command_that_does_not_exist_is_told_apart() -> None:
    # The check above can fail: argparse refuses a command it does not know.
    result = subprocess.run(
        [script(CTL), "no-such-command", "--help"],
        capture_output=True,
        text=True,
        timeout=HELP_TIMEOUT,
        check=False,
    )
    assert result.returncode == 2, result
    assert "invalid choice" in result.stderr


def test_every_script_the_readme_runs_exists_with_its_flags() -> None:
    ran = set()
    for argv in COMMANDS:
        if argv[0] == "bash":
            assert (ROOT / argv[1]).is_file(), " ".join(argv)
            ran.add(argv[1])
        elif argv[0].startswith("python") and argv[1].endswith(".py"):
            path = ROOT / argv[1]
            assert path.is_file(), " ".join(argv)
            known = flags(help_of(sys.executable, str(path)))
            unknown = flags(" ".join(argv[2:])) - known
            assert not unknown, f"{' '.join(argv)}: {argv[1]} has no {unknown}"
            ran.add(argv[1])
        elif argv[0] == "jupyter":
            notebooks = [word for word in argv[2:] if not word.startswith("-")]
            assert notebooks, " ".join(argv)
            for word in notebooks:
                assert (ROOT / word).exists(), " ".join(argv)
            ran.add(argv[1])
    assert {".ci/run", "examples/train_async_sgd.py", "benchmarks/bench_node.py"} <= ran, ran


def extras() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["optional-dependencies"])


# The name a requirement starts with ("torch>=2.1", "torch==2.13.0": torch).
REQUIREMENT_NAME = re.compile(r"[A-Za-z0-9][\w.-]*")


def dependencies() -> set[str]:
    """The names of the packages pyproject asks for, the extras' included (not the project)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"].values()
    wanted = [*project["dependencies"], *(r for group in extras for r in group)]
    names = {m[0].lower() for r in wanted if (m := REQUIREMENT_NAME.match(r))}
    return names - {project["name"]}


# Options of pip install whose value is a place to install from, not a requirement.
INDEX_OPTIONS = {"--index-url", "--extra-index-url", "-i"}


def test_every_install_is_from_the_checkout_with_extras_that_exist() -> None:
    known = extras()
    needed = dependencies()
    assert {"numpy", "torch"} <= needed  # (pyproject was read)
    installs = 0
    for argv in COMMANDS:
        words = argv[2:] if argv[0].startswith("python") and argv[1:3] == ["-m", "pip"] else argv
        if words[:2] != ["pip", "install"] and words[:1] != ["install"]:
            continue
        words = words[2:] if words[0] == "pip" else words[1:]
        values = {i + 1 for i, w in enumerate(words) if w in INDEX_OPTIONS}
        for i, requirement in enumerate(words):
            if requirement.startswith("-") or i in values:
                continue
            # A package the project depends on may be installed first, on its own (torch's
            # CPU build, from PyTorch's index, before the [torch] extra).
            name = REQUIREMENT_NAME.match(requirement)
            if name and name[0].lower() in needed:
                continue
            installs += 1
            # The package is not on an index: it is installed from this directory.
            match = re.fullmatch(r"\.(?:\[(?P<extras>[\w,-]+)\])?", requirement)
            assert match, f"{' '.join(argv)}: install '.' or '.[extra]', not {requirement!r}"
            named = set((match["extras"] or "").split(",")) - {""}
            assert named <= known, f"{' '.join(argv)}: no extra {named - known} in pyproject"
    assert installs >= 3


def test_the_extras_the_pages_name_in_prose_exist() -> None:
    # `'.[torch]'` alone, as in "and `'.[torch]'` for the last".
    named = [group for text in TEXTS.values() for group in re.findall(r"'\.\[([\w,-]+)\]'", text)]
    assert named
    for group in named:
        assert set(group.split(",")) <= extras(), group


def test_no_install_names_the_package_as_if_on_an_index() -> None:
    for path in INSTALL_DOCS:
        if path.is_file():
            text = path.read_text(errors="replace")
            assert "aioparamsync[" not in text, f"{path.relative_to(ROOT)}: use '.[extra]'"


def tox_environments() -> set[str]:
    text = (ROOT / "tox.ini").read_text()
    envs = set(re.findall(r"^\[testenv:([\w.-]+)\]", text, re.MULTILINE))
    if match := re.search(r"^envlist *= *(.+)$", text, re.MULTILINE):
        envs |= {env.strip() for env in match[1].split(",")}
    return envs


def test_every_tox_environment_exists() -> None:
    known = tox_environments()
    named = [argv[2] for argv in COMMANDS if argv[:2] == ["tox", "-e"]]
    assert named
    for env in named:
        assert env in known, f"tox.ini has no environment {env!r} (it has {sorted(known)})"


def test_the_license_file_is_apache_2() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
