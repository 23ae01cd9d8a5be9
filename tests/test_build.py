"""How the package is built: the image's wheel, the compiled modules, the installs.

The image's wheel is built as the Dockerfile builds it (its own ``pip wheel``
command, read from it) from exactly the files its .dockerignore admits (copied by
the .dockerignore's own rules), with the compile: the Dockerfile compiles
(``AIOPARAMSYNC_REQUIRE_EXT=1``), so a build without it would not be the image's,
and that one build (minutes) serves every test of the wheel and of the installs
below. No docker daemon is needed: the Dockerfile's stage does no more than this.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from build_helpers import (
    BUILD_TIMEOUT,
    ROOT,
    admitted,
    context_files,
    copy_context,
    dockerfile,
    dockerignore,
    wheel_command,
)

# A test of a build may wait for the one compiled build (its fixture), then build again.
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT + 120)
# What a program run against an install prints: which path runs, and from where.
REPORT = """
import importlib, json, sys, aioparamsync, aioparamsync.node
from aioparamsync._ext import compiled_modules
files = {}
for m in sys.argv[1:]:  # (each module's file: None where it cannot be imported)
    try:
        files[m] = importlib.import_module(m).__file__
    except ModuleNotFoundError:
        files[m] = None
print(json.dumps({
    "extension": aioparamsync.has_extension(),
    "package": aioparamsync.__file__,
    "compiled": {m: sys.modules[m].__file__ for m in compiled_modules()},
    "files": files,
}))
"""


def load_hatch_build(root: Path = ROOT) -> ModuleType:
    spec = importlib.util.spec_from_file_location("hatch_build_under_test", root / "hatch_build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hatch_build = load_hatch_build()
SOURCES = hatch_build.CYTHON_MODULES + hatch_build.COMPILED_MODULES
WANTED = {hatch_build.module_name(s) for s in SOURCES}
# The module whose source is edited after an editable install.
EDITED = SOURCES[0]
EDITED_NAME = hatch_build.module_name(EDITED)


def from_source(tree: Path) -> str | None:
    """The file EDITED_NAME is imported from when it runs from its source in ``tree``
    (None for a module written for Cython: it has no Python source)."""
    return str(tree / EDITED) if EDITED.endswith(".py") else None


def files_under(directory: Path) -> dict[str, int]:
    """Every file under ``directory``, with its size."""
    return {
        p.relative_to(directory).as_posix(): p.stat().st_size
        for p in directory.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIOPARAMSYNC_", "PYTHON"))}
    return {**env, **extra}


def report(
    python: str | Path, cwd: Path, modules: tuple[str, ...] = (EDITED_NAME,), **env: str
) -> tuple[dict[str, Any], str]:
    """What REPORT prints when run by ``python`` in ``cwd`` (importing ``modules`` by name,
    and the node), and the warnings it printed."""
    done = subprocess.run(
        [str(python), "-W", "always", "-c", REPORT, *modules],
        cwd=cwd,
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def pip(*args: str | Path, timeout: float = BUILD_TIMEOUT, **env: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pip", *map(str, args)],
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done.stdout + done.stderr


# -- the build context ----------------------------------------------------------------


def test_the_dockerignore_rules_read_as_docker_reads_them(tmp_path: Path) -> None:
    (tmp_path / ".dockerignore").write_text(
        "# a comment\n*\n!keep.txt\n!pkg/\n**/__pycache__\npkg/drop*.py\n!pkg/drop_not.py\n"
    )
    rules = dockerignore(tmp_path / ".dockerignore")
    expected = {
        "keep.txt": True,
        "other.txt": False,
        "pkg/a.py": True,
        "pkg/sub/b.py": True,
        "pkg/sub/__pycache__/b.pyc": False,
        "pkg/drop_me.py": False,
        "pkg/drop_not.py": True,
        "top/pkg/a.py": False,
    }
    assert {p: admitted(p, rules) for p in expected} == expected
    for name in expected:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    assert context_files(tmp_path) == sorted(p for p, kept in expected.items() if kept)


def test_the_context_holds_every_file_the_build_reads() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    build = project["tool"]["hatch"]["build"]
    wheel = build["targets"]["wheel"]
    read = {"pyproject.toml", project["project"]["readme"], "LICENSE"}
    read.add(build["hooks"]["custom"].get("path", "hatch_build.py"))
    read |= {f"{p}/__init__.py" for p in wheel["packages"]}
    read |= set(wheel.get("force-include", {}))
    read |= set(SOURCES)
    rules = dockerignore()
    missing = {path for path in read if not admitted(path, rules)}
    assert not missing, f".dockerignore leaves out what the build reads: {sorted(missing)}"


# -- the image's wheel, built once ------------------------------------------------------


class Built:
    """The image's wheel, built from a copy of its context by the Dockerfile's command."""

    def __init__(self, base: Path) -> None:
        self.context = base / "context"
        self.wheels = base / "wheels"
        self.copied = copy_context(self.context)
        self.package_before = files_under(self.context / "aioparamsync")
        self.done = wheel_command().run(self.context, self.wheels)
        self.output = self.done.stdout + self.done.stderr

    def wheel(self) -> Path:
        assert self.done.returncode == 0, self.output[-6000:]
        (wheel,) = self.wheels.glob("*.whl")
        return wheel


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return Built(tmp_path_factory.mktemp("image"))


@pytest.mark.slow
def test_the_image_wheel_builds_from_its_context_with_the_dockerfile_command(built: Built) -> None:
    wheel = built.wheel()
    assert "hatch_build.py" in built.copied and "tests/conftest.py" not in built.copied
    # the runtime stage installs it by this name
    (install,) = [rest for word, rest in dockerfile() if word == "RUN" and "pip install" in rest]
    pattern = re.search(r"/wheels/(\S+\.whl)", install)
    assert pattern and fnmatch.fnmatch(wheel.name, pattern.group(1)), (wheel.name, install)
    assert not wheel.name.endswith("-none-any.whl"), wheel.name  # (compiled: a platform's)
    names = set(zipfile.ZipFile(wheel).namelist())
    extensions = {hatch_build.extension_path(s) for s in SOURCES}
    assert extensions <= names, sorted(extensions - names)
    assert {"aioparamsync/aioparamsync.thrift", "aioparamsync/ml_param_sync.thrift"} <= names
    assert not [n for n in names if n.endswith((".pyx", ".c"))]
    # the build log says what it does: a line per module compiled
    assert f"[{len(SOURCES)}/{len(SOURCES)}]" in built.output, built.output[-3000:]


@pytest.mark.slow
def test_a_wheel_build_writes_nothing_beside_the_sources(built: Built) -> None:
    built.wheel()
    after = files_under(built.context / "aioparamsync")
    assert after == built.package_before, sorted(set(after) ^ set(built.package_before))
    strays = [
        p for p in built.context.rglob("*.so") if "build" not in p.relative_to(built.context).parts
    ]
    assert not strays, strays


@pytest.mark.slow
def test_the_installed_wheel_runs_its_compiled_modules(built: Built, tmp_path: Path) -> None:
    site = tmp_path / "site"
    pip("install", "--no-deps", "--no-index", "--target", site, built.wheel(), timeout=120)
    got, warned = report(sys.executable, tmp_path, PYTHONPATH=str(site))
    assert got["package"] == str(site / "aioparamsync" / "__init__.py")
    assert got["extension"] and set(got["compiled"]) >= WANTED, sorted(
        WANTED - set(got["compiled"])
    )
    assert all(Path(f).is_relative_to(site) for f in got["compiled"].values())
    assert not warned
    # and the same install runs its pure path when asked
    got, _ = report(sys.executable, tmp_path, (), PYTHONPATH=str(site), AIOPARAMSYNC_NO_EXT="1")
    assert not got["extension"] and not got["compiled"]


# -- an editable install ----------------------------------------------------------------


class Editable:
    """A fresh venv with an editable install of a copy of the context (its compiled cache)."""

    def __init__(self, built: Built, base: Path) -> None:
        self.tree = base / "tree"
        shutil.copytree(built.context, self.tree)  # (build/ too: nothing is compiled again)
        self.venv = base / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", self.venv], check=True)
        self.python = self.venv / "bin" / "python"
        site = subprocess.run(
            [self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        self.site = Path(site)
        # its dependencies are this environment's (numpy, thriftpy2, ...): after its own
        deps = [p for p in sys.path if p.endswith("site-packages")]
        (self.site / "zz_dependencies.pth").write_text("\n".join(deps) + "\n")
        self.output = pip(
            "--python",
            self.python,
            "install",
            "-v",
            "--no-deps",
            "-e",
            self.tree,
            AIOPARAMSYNC_REQUIRE_EXT="1",
        )
        self.manifest = self.site / hatch_build.EDITABLE_DIR / hatch_build.MANIFEST


@pytest.fixture(scope="module")
def editable(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Editable:
    built.wheel()
    return Editable(built, tmp_path_factory.mktemp("editable"))


@pytest.fixture
def restored(editable: Editable) -> Iterator[Editable]:
    """The editable install; its manifest and the edited source are put back after the test."""
    saved = {p: p.read_bytes() for p in [editable.manifest, editable.tree / EDITED]}
    yield editable
    for path, data in saved.items():
        path.write_bytes(data)


@pytest.mark.slow
def test_an_editable_install_runs_the_compiled_modules_from_site_packages(
    editable: Editable, tmp_path: Path
) -> None:
    assert f"{hatch_build.modules(len(SOURCES))} compiled already" in editable.output, (
        editable.output[-3000:]
    )
    got, warned = report(editable.python, tmp_path)
    assert got["package"] == str(editable.tree / "aioparamsync" / "__init__.py")
    assert got["extension"] and set(got["compiled"]) >= WANTED, sorted(
        WANTED - set(got["compiled"])
    )
    compiled_dir = editable.site / hatch_build.EDITABLE_DIR
    assert all(Path(f).is_relative_to(compiled_dir) for f in got["compiled"].values())
    assert not warned
    assert not list((editable.tree / "aioparamsync").rglob("*.so"))


@pytest.mark.slow
def test_an_edited_source_runs_with_a_warning_until_compiled_again(
    restored: Editable, tmp_path: Path
) -> None:
    edited = restored.tree / EDITED
    edited.write_text(edited.read_text() + "\n# edited after the install\n")
    got, warned = report(restored.python, tmp_path)
    assert got["files"][EDITED_NAME] == from_source(restored.tree)
    assert set(got["compiled"]) == WANTED - {EDITED_NAME}, got["compiled"]
    assert "StaleExtensionWarning" in warned and EDITED_NAME in warned, warned
    assert "pip install -e ." in warned, warned


@pytest.mark.slow
@pytest.mark.parametrize(
    "manifest",
    ["{not json", '{"tree": 3, "modules": {}}', '{"modules": {}}', '["a list"]'],
    ids=["not-json", "tree-not-a-path", "no-tree", "not-an-object"],
)
def test_a_manifest_that_cannot_be_read_is_ignored_with_a_warning(
    restored: Editable, tmp_path: Path, manifest: str
) -> None:
    restored.manifest.write_text(manifest)
    got, warned = report(restored.python, tmp_path)
    assert not got["extension"] and not got["compiled"]
    assert "cannot be read" in warned and str(restored.manifest) in warned, warned


@pytest.mark.slow
def test_a_manifest_of_another_tree_or_a_missing_module_is_not_used(
    restored: Editable, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    shutil.copytree(restored.tree, other, ignore=shutil.ignore_patterns("build"))
    # with extension modules beside its sources, as an older build left them: not imported
    for source in SOURCES:
        path = hatch_build.extension_path(source)
        shutil.copy(restored.site / hatch_build.EDITABLE_DIR / path, other / path)
    got, warned = report(restored.python, tmp_path, PYTHONPATH=str(other))
    assert got["package"] == str(other / "aioparamsync" / "__init__.py")
    assert not got["extension"] and not got["compiled"] and not warned
    assert got["files"][EDITED_NAME] == from_source(other)
    # a module whose extension is gone runs from source, with a warning
    extension = restored.site / hatch_build.EDITABLE_DIR / hatch_build.extension_path(EDITED)
    extension.rename(tmp_path / "moved.so")
    try:
        got, warned = report(restored.python, tmp_path)
        assert got["files"][EDITED_NAME] == from_source(restored.tree)
        assert set(got["compiled"]) == WANTED - {EDITED_NAME}, got["compiled"]
        assert EDITED_NAME in warned, warned
    finally:
        (tmp_path / "moved.so").rename(extension)


# -- what goes wrong: no compiler, the compile skipped ----------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("env", "fails", "says"),
    [
        ({"CC": "false", "AIOPARAMSYNC_REQUIRE_EXT": "1"}, True, "AIOPARAMSYNC_REQUIRE_EXT is set"),
        ({"CC": "false"}, False, "the compiled fast path was not built"),
        ({"AIOPARAMSYNC_NO_EXT": "1", "AIOPARAMSYNC_REQUIRE_EXT": "1"}, False, "NO_EXT is set"),
    ],
    ids=["no-compiler-required", "no-compiler", "skipped"],
)
def test_a_build_without_the_compile_is_pure_python_or_fails_when_required(
    tmp_path: Path, env: dict[str, str], fails: bool, says: str
) -> None:
    copy_context(tmp_path / "context")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", tmp_path / "wheels", "."],
        cwd=tmp_path / "context",
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
    )
    output = done.stdout + done.stderr
    assert says in output, output[-4000:]
    if fails:
        assert done.returncode != 0 and not list(tmp_path.glob("wheels/*.whl"))
        return
    assert done.returncode == 0, output[-4000:]
    (wheel,) = (tmp_path / "wheels").glob("*.whl")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".so")]
