"""Strip the notebooks' outputs before committing: `python tools/strip_notebooks.py [--check] [NOTEBOOK ...]`
(default: every notebooks/*.ipynb).

A committed notebook holds only its sources: no outputs, execution counts null, no per-cell execution
metadata (timings that nbclient or Jupyter record). `--check` changes nothing and exits 1 naming the notebooks
that still hold any of it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
RUN_METADATA = ("execution", "collapsed", "scrolled", "ExecuteTime")  # what running or viewing a cell records


def unstripped_cells(nb) -> list[str]:
    """What a notebook still holds that a committed one must not, one line per cell."""
    out = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        found = []
        if cell.get("outputs"):
            found.append(f"{len(cell.outputs)} output(s)")
        if cell.get("execution_count") is not None:
            found.append(f"execution_count {cell.execution_count}")
        found += [f"metadata.{k}" for k in RUN_METADATA if k in cell.get("metadata", {})]
        if found:
            out.append(f"cell {i}: " + ", ".join(found))
    return out


def strip(nb) -> None:
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        for k in RUN_METADATA:
            cell.get("metadata", {}).pop(k, None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="report notebooks that hold outputs, change nothing")
    ap.add_argument("notebooks", nargs="*", type=Path)
    a = ap.parse_args(argv)
    dirty = 0
    for path in a.notebooks or sorted(NOTEBOOK_DIR.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        found = unstripped_cells(nb)
        if not found:
            continue
        dirty += 1
        if a.check:
            print(f"{path}: not stripped: " + "; ".join(found))
        else:
            strip(nb)
            nbformat.write(nb, path)
            print(f"{path}: stripped")
    return 1 if a.check and dirty else 0


if __name__ == "__main__":
    sys.exit(main())
