"""The notebooks in examples/ run top to bottom without an error, and are committed stripped.

Each notebook runs on a fresh ``python3`` kernel of *this* interpreter (ipykernel, from the
test extra), in ``examples/``, with a deadline per cell and one for the whole notebook. The
kernel spec is ipykernel's own, whatever ``python3`` kernel spec a user or system directory
may hold that points at another Python: the notebooks must import the aioparamsync under test.

A cell fails the test by raising, and so does anything on its stderr (a warning, a logged
error, a traceback printed by a task) other than the known harmless messages below.
The committed files carry no outputs and no execution counts: clear them before committing
(Jupyter's "Clear All Outputs", or ``jupyter nbconvert --clear-output --inplace``).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from traitlets.config import Config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = ["quickstart.ipynb", "cluster.ipynb", "async_training.ipynb"]
# Notebooks whose last run must have drawn a figure (an image/png output).
PLOTS = {"cluster.ipynb", "async_training.ipynb"}

KERNEL = "python3"
# Deadlines (seconds): starting the kernel, one cell, and the whole notebook (each
# runs in a few seconds on 2 cores; the first import of matplotlib in a fresh venv
# builds its font cache, which takes a few more).
STARTUP_TIMEOUT = 60
CELL_TIMEOUT = 60
NOTEBOOK_TIMEOUT = 60

# stderr that says nothing is wrong.
HARMLESS_STDERR = re.compile(r"^Matplotlib is building the font cache; this may take a moment\.$")

pytestmark = pytest.mark.timeout(STARTUP_TIMEOUT + NOTEBOOK_TIMEOUT + 30)


def read(name: str) -> nbformat.NotebookNode:
    nb = nbformat.read(EXAMPLES / name, as_version=nbformat.NO_CONVERT)
    nbformat.validate(nb)
    return nb


def test_every_notebook_is_tested() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.ipynb")) == sorted(NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_stripped(name: str) -> None:
    nb = read(name)
    assert nb.metadata.get("kernelspec", {}).get("name") == KERNEL, "the kernel is python3"
    assert "widgets" not in nb.metadata, "widget state is output: strip it"
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code, "a notebook without code"
    for i, cell in enumerate(nb.cells):
        where = f"{name}, cell {i} ({cell.source.splitlines()[0] if cell.source else ''!r})"
        if cell.cell_type != "code":
            continue
        assert cell.outputs == [], f"{where} has outputs: strip them"
        assert cell.execution_count is None, f"{where} has an execution count: strip it"
        assert "execution" not in cell.metadata, f"{where} has execution timings: strip them"


def _problems(nb: nbformat.NotebookNode) -> list[str]:
    """What the executed notebook's cells wrote to stderr, less the harmless lines."""
    found = []
    for i, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if output.output_type == "stream" and output.name == "stderr":
                lines = [
                    line
                    for line in output.text.splitlines()
                    if line.strip() and not HARMLESS_STDERR.match(line)
                ]
                if lines:
                    found.append(f"cell {i} wrote to stderr:\n" + "\n".join(lines))
            elif output.output_type == "error":  # only with allow_errors; never here
                found.append(f"cell {i} raised {output.ename}: {output.evalue}")
    return found


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_runs(name: str) -> None:
    nb = read(name)
    config = Config()
    # Only ipykernel's own python3 kernel spec, which runs sys.executable: not one that a
    # user's or the system's Jupyter directories hold for another interpreter.
    config.KernelSpecManager.kernel_dirs = []
    client = NotebookClient(
        nb,
        config=config,
        kernel_name=KERNEL,
        timeout=CELL_TIMEOUT,
        startup_timeout=STARTUP_TIMEOUT,
        allow_errors=False,  # a cell that raises raises CellExecutionError here
        resources={"metadata": {"path": str(EXAMPLES)}},
    )
    started = time.monotonic()
    client.execute()
    elapsed = time.monotonic() - started

    problems = _problems(nb)
    assert not problems, "\n\n".join(problems)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(cell.execution_count is not None for cell in code), "a cell did not run"
    if name in PLOTS:
        images = [
            output
            for cell in code
            for output in cell.outputs
            if "image/png" in output.get("data", {})
        ]
        assert images, f"{name} drew no figure"
    assert elapsed < NOTEBOOK_TIMEOUT, f"{name} took {elapsed:.1f} s"
