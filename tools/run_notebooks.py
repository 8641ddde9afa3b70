"""Execute the notebooks: `python tools/run_notebooks.py [--out DIR] [NOTEBOOK ...]` (default: every
notebooks/*.ipynb).

Each notebook runs top to bottom in a fresh kernel of this Python interpreter, started in the repository root
with the root first on PYTHONPATH, so the notebooks import this checkout's packages whatever is installed.
The executed copies are not written back - committed notebooks keep no outputs (tools/strip_notebooks.py) -
but `--out DIR` saves them there to read. The first failing cell stops a notebook; the error names the
notebook and the cell, with the cell's source and traceback. Prints each notebook's wall time; exits 1 if any
failed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from pathlib import Path

import nbformat
from ipykernel.kernelspec import write_kernel_spec
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
CELL_TIMEOUT_S = 900
_ANSI_COLOR = re.compile(r"\x1b\[[0-9;]*m")


class NotebookError(RuntimeError):
    """A notebook failed to run; the message names the notebook and the failing cell."""


def notebooks() -> list[Path]:
    return sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def kernel_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def execute(path: Path, out_dir: Path | None = None) -> float:
    """Run one notebook; its wall time in seconds. Raises NotebookError on the first failing cell. With
    `out_dir`, the executed copy (outputs included, up to the failing cell) is written there."""
    nb = nbformat.read(path, as_version=4)
    # An explicit kernel spec for this interpreter: a `python3` kernelspec found on the Jupyter path could
    # belong to another Python, which would not have this project's dependencies.
    spec_dir = Path(write_kernel_spec())
    try:
        km = KernelManager(kernel_name=spec_dir.name, transport="ipc",
                           kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec_dir.parent)]))
        client = NotebookClient(nb, km=km, timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(ROOT)}})
        start = time.perf_counter()
        try:
            client.execute(cleanup_kc=True, env=kernel_env())
        except CellExecutionError as e:
            report = _ANSI_COLOR.sub("", str(e))  # IPython colours its tracebacks; a test log shows the codes
            raise NotebookError(f"{path.name}: {_failing_cell(nb)} failed\n{report}") from None
        finally:
            if out_dir is not None:
                out_dir.mkdir(parents=True, exist_ok=True)
                nbformat.write(nb, out_dir / path.name)
        return time.perf_counter() - start
    finally:
        shutil.rmtree(spec_dir.parent, ignore_errors=True)


def _failing_cell(nb) -> str:
    for i, cell in enumerate(nb.cells):
        if any(o.get("output_type") == "error" for o in cell.get("outputs", ())):
            return f"cell {i} (execution count {cell.get('execution_count')})"
    return "a cell"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the executed notebooks (with outputs) into this folder")
    ap.add_argument("notebooks", nargs="*", type=Path, help="default: every notebooks/*.ipynb")
    a = ap.parse_args(argv)
    paths = a.notebooks or notebooks()
    failed = 0
    for path in paths:
        try:
            seconds = execute(path, a.out)
            print(f"{path.name}: ok in {seconds:.1f} s", flush=True)
        except NotebookError as e:
            failed += 1
            print(f"{path.name}: FAILED\n{e}", file=sys.stderr, flush=True)
    print(f"{len(paths) - failed} of {len(paths)} notebooks ran")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
