"""docs/ builds into a site with no warning, the README's links lead somewhere, and the
command-line page says what the two programs' ``--help`` says.

The site is built as a user builds it, ``python -m mkdocs build --strict`` (mkdocs.yml
turns every check MkDocs has into a warning: a link to a page, an anchor or a file that
does not exist, a page left out of the nav), in a directory of the test's own; any
warning fails. A copy of the pages with one fault of each kind shows that the build
does fail on them.

The command-line page (docs/cli.md) has a table row per flag, ``| `--flag METAVAR` |
default | what it does |``: under "## aioparamsync-node", every flag of the node's
``--help``; under "### Options of every command", ``aioparamsync-ctl``'s own; under a
heading "#### `aioparamsync-ctl COMMAND ARGS`" per command, the arguments of its usage
and the flags it adds. The default is the text of the help's "default: ...", or "—".
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify
from test_readme import CTL, NODE, README, ROOT, help_of, script

DOCS = ROOT / "docs"
CLI_PAGE = DOCS / "cli.md"
# Bounds (seconds) of one build.
BUILD_TIMEOUT = 120.0

pytestmark = pytest.mark.timeout(2 * BUILD_TIMEOUT + 60)


# -- the site ---------------------------------------------------------------------------------


def build(config: Path, site: Path) -> str:
    """Build the site of ``config`` into ``site``: MkDocs's output (its exit status is in it)."""
    command = ["build", "--strict", "--config-file", str(config), "--site-dir", str(site)]
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", *command],
        cwd=config.parent,
        # (mkdocs-material's notice about MkDocs 2.0 is not about these pages)
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
        check=False,
    )
    return f"exit status {result.returncode}\n{result.stdout}{result.stderr}"


def warnings_of(output: str) -> list[str]:
    """MkDocs's warnings and errors, each with the indented lines that go on with it."""
    found: list[str] = []
    going_on = False
    for line in output.splitlines():
        if line.startswith(("WARNING", "ERROR")):
            found.append(line)
            going_on = True
        elif going_on and line.startswith("  "):
            found[-1] += "\n" + line
        else:
            going_on = False
    return found


def test_the_site_builds_with_no_warning(tmp_path: Path) -> None:
    site = tmp_path / "site"
    output = build(ROOT / "mkdocs.yml", site)
    assert output.startswith("exit status 0\n") and not warnings_of(output), output
    pages = sorted(DOCS.glob("*.md"))
    assert len(pages) >= 14, pages  # (the glob found the pages)
    for page in pages:
        built = site / ("index.html" if page.stem == "index" else f"{page.stem}/index.html")
        assert built.is_file(), f"{page.name} is not in the site"
    # The files of the repository the pages link to are copied in, and the links lead there.
    assert (site / "src" / "idl" / "aioparamsync.thrift").is_file()
    assert 'href="../src/idl/aioparamsync.thrift"' in (site / "wire" / "index.html").read_text()


def faulty_copy(root: Path) -> Path:
    """The pages and mkdocs.yml copied under ``root`` (the rest of the repository linked
    beside them, so the links to its files still lead somewhere), then given three faults."""
    root.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in ("docs", "mkdocs.yml", "site") and not entry.name.startswith("."):
            (root / entry.name).symlink_to(entry)
    shutil.copy(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    shutil.copytree(DOCS, root / "docs")
    with (root / "docs" / "index.md").open("a", encoding="utf-8") as index:
        index.write("\n[gone](../examples/no_such_example.py)\n")
        index.write("\n[no heading](cluster.md#no-such-heading)\n")
    (root / "docs" / "stray.md").write_text("# A page left out of the nav\n", encoding="utf-8")
    return root / "mkdocs.yml"


def test_a_broken_link_a_broken_anchor_or_a_page_out_of_the_nav_fails_the_build(
    tmp_path: Path,
) -> None:
    output = build(faulty_copy(tmp_path / "copy"), tmp_path / "site")
    assert not output.startswith("exit status 0\n"), output
    warnings = "\n".join(warnings_of(output))
    assert "no_such_example.py" in warnings, output
    assert "no-such-heading" in warnings, output
    assert "stray.md" in warnings, output
    assert len(warnings_of(output)) == 3, output  # (and the rest of the copy is sound)


# -- the README's links -----------------------------------------------------------------------

# A Markdown link to a relative path, with its anchor if any.
LINK = re.compile(r"\]\((?![a-z][a-z0-9+.-]*:)(?P<path>[^)\s#]*)(?:#(?P<anchor>[^)\s]*))?\)")
HEADING = re.compile(r"^#{1,6} +(?P<title>.+?) *$", re.MULTILINE)


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, as MkDocs makes them (Python-Markdown's toc)."""
    return {slugify(title.replace("`", ""), "-") for title in HEADING.findall(page.read_text())}


def test_the_readme_links_lead_somewhere() -> None:
    # The README is no page of the site: its links to docs/ are checked here.
    text = README.read_text(encoding="utf-8")
    links = [m for m in LINK.finditer(text) if m["path"]]
    assert sum(m["path"].startswith("docs/") for m in links) >= 10, links
    for link in links:
        target = ROOT / link["path"]
        assert target.exists(), f"README.md links to {link['path']}, which does not exist"
        if link["anchor"]:
            assert link["anchor"] in anchors(target), f"{link['path']} has no #{link['anchor']}"


def test_a_link_to_a_missing_anchor_is_told_apart() -> None:
    # The check above can fail: a heading's anchor is found, another is not.
    found = anchors(DOCS / "quickstart.md")
    assert "blocking-client" in found and "use-it-from-python" in found
    assert "no-such-heading" not in found


# -- the command-line page --------------------------------------------------------------------

# An option of a --help: its flag, metavar and text (the text's next lines join it).
OPTION = re.compile(r"^  (?:-\w, )?(?P<flag>--[a-z][a-z0-9-]*)(?: \S+)?(?: {2,}(?P<text>.*))?$")
DEFAULT = re.compile(r"default: (?P<value>[^;)]*)")
# A row of a flag table on the page: its flag and its default.
ROW = re.compile(r"^\| `(?P<flag>--[a-z][a-z0-9-]*)[^`]*` \| (?P<default>[^|]*) \|", re.MULTILINE)
COMMAND = re.compile(r"^#### `aioparamsync-ctl (?P<name>[\w-]+)(?P<args>[^`]*)`$", re.MULTILINE)
# The commands listed in aioparamsync-ctl's --help (under COMMAND, indented four).
COMMAND_LISTED = re.compile(r"^    (?P<name>[a-z][\w-]*)(?: {2,}|$)", re.MULTILINE)


def options(help_text: str) -> dict[str, str]:
    """flag -> its default as the help says it ("—": none)."""
    texts: dict[str, str] = {}
    flag = None
    for line in help_text.splitlines():
        if match := OPTION.match(line):
            flag = match["flag"]
            texts[flag] = match["text"] or ""
        elif flag is not None and line.startswith("    "):
            texts[flag] += " " + line.strip()
        else:
            flag = None
    defaults = {}
    for flag, text in texts.items():
        match = DEFAULT.search(text)
        defaults[flag] = " ".join(match["value"].split()) if match else "—"
    return defaults


def rows(text: str) -> dict[str, str]:
    """flag -> the default its row on the page says (code marks left out)."""
    found: dict[str, str] = {}
    for match in ROW.finditer(text):
        assert match["flag"] not in found, f"{match['flag']} has two rows"
        found[match["flag"]] = match["default"].replace("`", "").strip()
    return found


def between(text: str, start: str, end: str | None) -> str:
    """The part of the page from the line ``start`` to the line ``end`` (or the page's end)."""
    begin = text.index(f"\n{start}\n")
    return text[begin : text.index(f"\n{end}\n", begin) if end else len(text)]


CLI_TEXT = CLI_PAGE.read_text(encoding="utf-8")


def test_the_cli_page_has_every_flag_of_the_node_with_its_default() -> None:
    helped = options(help_of(script(NODE)))
    assert {"--port", "--peers", "--data-dir", "--tls-ca"} <= set(helped)  # the help was read
    assert helped["--port"] == "9090"
    documented = rows(between(CLI_TEXT, "## aioparamsync-node", "## aioparamsync-ctl"))
    assert documented == helped, {
        "not on the page": sorted(set(helped) - set(documented)),
        "not in --help": sorted(set(documented) - set(helped)),
        "another default": {
            f: (documented[f], helped[f])
            for f in set(helped) & set(documented)
            if documented[f] != helped[f]
        },
    }


def test_the_cli_page_has_every_ctl_command_its_arguments_and_flags() -> None:
    ctl = script(CTL)
    top = help_of(ctl)
    shared = options(top)
    assert {"--json", "--timeout", "--tls"} <= set(shared)
    documented = rows(between(CLI_TEXT, "### Options of every command", "### The commands"))
    assert documented == shared
    listed_section = top[top.index("  COMMAND\n") : top.index("\noptions:")]
    listed = [m["name"] for m in COMMAND_LISTED.finditer(listed_section)]
    assert {"stats", "get", "drain", "shutdown"} <= set(listed), listed
    commands_part = between(CLI_TEXT, "### The commands", "## Checkpoints and export")
    headings = list(COMMAND.finditer(commands_part))
    assert [h["name"] for h in headings] == listed, "the commands, as --help lists them"
    for i, heading in enumerate(headings):
        name = heading["name"]
        usage = help_of(ctl, name)
        # The usage's arguments: what is left of its first lines once the options are out.
        line = " ".join(usage[: usage.index("\n\n")].split())
        arguments = re.sub(r"\[-[^\]]*\]", "", line.removeprefix(f"usage: {CTL} {name}"))
        assert heading["args"].split() == arguments.split(), (name, usage)
        end = headings[i + 1].start() if i + 1 < len(headings) else len(commands_part)
        own = {f: d for f, d in options(usage).items() if f not in shared}
        assert rows(commands_part[heading.end() : end]) == own, (name, usage)


def test_a_flag_missing_from_the_page_is_told_apart() -> None:
    # The checks above can fail: a row left out, a default changed, a flag too many.
    page = between(CLI_TEXT, "## aioparamsync-node", "## aioparamsync-ctl")
    helped = options(help_of(script(NODE)))
    assert rows(page.replace("| `--port PORT` |", "| port |")) != helped
    assert rows(page.replace("| `9090` |", "| `9091` |")) != helped
    assert rows(page + "| `--no-such-flag` | — | nothing |\n") != helped
