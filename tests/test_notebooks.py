"""The notebooks (every notebooks/*.ipynb) run top to bottom without an error, and
are committed without outputs. They run as `make notebooks` runs them (tools/run_notebooks.py): nbclient, a
kernel of this interpreter started in the repository root with the root on PYTHONPATH. A failure names the
notebook and the failing cell, with the cell's source and its traceback."""

import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from tools import run_notebooks, strip_notebooks

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = run_notebooks.notebooks()


def test_the_notebooks_are_found():
    assert {"01_model_anatomy.ipynb", "02_replay.ipynb", "04_kernels.ipynb", "05_sharding.ipynb"} <= {
        p.name for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_without_outputs(path):
    found = strip_notebooks.unstripped_cells(nbformat.read(path, as_version=4))
    assert not found, f"{path.name} holds outputs (run `make strip-notebooks`): " + "; ".join(found)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    try:
        run_notebooks.execute(path)
    except run_notebooks.NotebookError as e:
        pytest.fail(str(e), pytrace=False)


def test_kernel_and_failure_report(tmp_path):
    """The kernel is this interpreter, in the repository root, importing this checkout's packages; a failing
    cell is reported with the notebook's name, the cell's index and source, and the exception."""
    checks = (f"import os, sys, serving\n"
              f"assert os.getcwd() == {str(ROOT)!r}, os.getcwd()\n"
              f"assert sys.executable == {sys.executable!r}, sys.executable\n"
              f"assert serving.__file__.startswith({str(ROOT) + os.sep!r}), serving.__file__")
    path = tmp_path / "broken.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell(checks), new_code_cell("ratio = 1 / 0  # fails here")]), path)
    with pytest.raises(run_notebooks.NotebookError) as failure:
        run_notebooks.execute(path)
    message = str(failure.value)
    assert message.startswith("broken.ipynb: cell 1 "), message  # cell 0, the checks, passed
    assert "ratio = 1 / 0  # fails here" in message
    assert "ZeroDivisionError" in message


def test_strip_tool(tmp_path):
    cell = new_code_cell("print(1)", execution_count=3, outputs=[nbformat.v4.new_output("stream", text="1\n")])
    cell.metadata["execution"] = {"iopub.execute_input": "2026-01-01T00:00:00Z"}
    path = tmp_path / "run.ipynb"
    nbformat.write(new_notebook(cells=[cell]), path)
    assert strip_notebooks.main(["--check", str(path)]) == 1
    assert strip_notebooks.main([str(path)]) == 0
    stripped = nbformat.read(path, as_version=4)
    assert strip_notebooks.unstripped_cells(stripped) == []
    assert stripped.cells[0].source == "print(1)" and stripped.cells[0].outputs == []
    assert strip_notebooks.main(["--check", str(path)]) == 0
