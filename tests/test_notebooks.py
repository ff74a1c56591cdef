"""The notebooks: each executes from a clean kernel without an error, and the committed copy holds the
outputs of such a run (what readers see on the code host; ``make notebooks`` regenerates them)."""

import importlib.util
import pathlib

import pytest

# The notebook tools are in the test extra (CI has them); a machine without them (the GPU image) still
# collects and runs the rest of the suite.
nbformat = pytest.importorskip("nbformat", reason="the notebook tests need nbformat and nbclient (test extra)")
pytest.importorskip("nbclient", reason="the notebook tests need nbformat and nbclient (test extra)")

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parents[1] / "notebooks"


def _load_runner():
  spec = importlib.util.spec_from_file_location("notebook_runner", NOTEBOOK_DIR / "run.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


run = _load_runner()
NOTEBOOKS = run.notebooks()


def test_every_issue_notebook_exists():
  names = {p.name for p in NOTEBOOKS}
  assert {"01_kda_prefill_and_checkpoints.ipynb", "02_mla_split_k_partials.ipynb",
          "03_sharded_k3_block.ipynb"} <= names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_holds_a_clean_run(path):
  nb = nbformat.read(path, as_version=4)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code, f"{path.name} has no code cells"
  # A run from a clean kernel numbers the cells 1, 2, ... in order and leaves no error output.
  assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), path.name
  errors = [o for c in code for o in c.outputs if o.output_type == "error"]
  assert not errors, f"{path.name}: {[e.ename for e in errors]}"
  assert any(c.outputs for c in code), f"{path.name} was committed without outputs"
  assert path.stat().st_size < run.MAX_BYTES, f"{path.name} is {path.stat().st_size} bytes"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes_from_a_clean_kernel(path):
  # CellExecutionError (the failing cell and its traceback) fails the test.
  nb, _ = run.execute(path)
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
