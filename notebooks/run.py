"""Executes the notebooks from a clean kernel and, with ``--write``, stores their outputs in the ``.ipynb``.

Usage: ``.venv/bin/python notebooks/run.py [--write] [NOTEBOOK ...]`` (default: every ``notebooks/*.ipynb``).
``make notebooks`` runs it with ``--write``; ``tests/test_notebooks.py`` runs the same ``execute`` without
writing. The kernel is the ``python3`` kernelspec, whose ``python`` command jupyter_client replaces by the
interpreter running this script, so the notebooks see the same venv.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent
CELL_TIMEOUT_S = 600
MAX_BYTES = 1 << 20  # a committed notebook (outputs and PNGs included) stays below 1 MiB


def notebooks() -> list[pathlib.Path]:
  """Every notebook of ``notebooks/``, in reading order."""
  return sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def execute(path: pathlib.Path) -> tuple[nbformat.NotebookNode, float]:
  """Runs every cell of ``path`` in a fresh ``python3`` kernel started in ``notebooks/``.

  Returns:
    The executed notebook (outputs filled in, no timing metadata, so a re-run changes only what the
    cells print) and the wall time in seconds.

  Raises:
    nbclient.exceptions.CellExecutionError: a cell raised; the message names the cell and the traceback.
  """
  nb = nbformat.read(path, as_version=4)
  client = NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S, record_timing=False,
                          resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
  start = time.perf_counter()
  client.execute()
  return nb, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--write", action="store_true", help="store the outputs in the .ipynb files")
  parser.add_argument("paths", nargs="*", type=pathlib.Path, help="notebooks to run (default: all)")
  args = parser.parse_args(argv)
  for path in args.paths or notebooks():
    nb, seconds = execute(path)
    line = f"{path.name}: executed in {seconds:.1f} s"
    if args.write:
      nbformat.write(nb, path)
      size = path.stat().st_size
      line += f", written ({size / 1024:.0f} KiB)"
      if size > MAX_BYTES:
        print(line, file=sys.stderr)
        print(f"{path.name} is over {MAX_BYTES // 1024} KiB: shrink its figures or outputs", file=sys.stderr)
        return 1
    print(line, flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
