"""Every notebook in colabs/ runs top to bottom in fast mode, on the venv's own Python."""

import json
import os
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

pytestmark = pytest.mark.integration  # starts processes (make test-fast leaves it out)

ROOT = pathlib.Path(__file__).resolve().parents[2]
COLABS = ROOT / "colabs"
NOTEBOOKS = sorted(COLABS.glob("*.ipynb"))
KERNEL = "tpu-embedding-test"


def test_notebooks_are_up_to_date_and_have_no_outputs():
  sys.path.insert(0, str(COLABS))
  try:
    import build_notebooks
  finally:
    sys.path.pop(0)
  assert sorted(p.name for p in NOTEBOOKS) == sorted(build_notebooks.NOTEBOOKS)
  for path in NOTEBOOKS:
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    expected = build_notebooks.NOTEBOOKS[path.name]
    assert [c.source for c in notebook.cells] == [c.source for c in expected], (
      f"{path.name} differs from colabs/build_notebooks.py; rerun it"
    )
    for cell in notebook.cells:
      assert cell.get("outputs", []) == [] and cell.get("execution_count") is None


@pytest.fixture(scope="module")
def kernel_specs(tmp_path_factory):
  """A kernelspec running this interpreter, whatever `python` is on PATH, with the repository's
  root on the path: the notebooks read their data through `examples/`, which is not installed."""
  kernels = tmp_path_factory.mktemp("jupyter") / "kernels"
  spec_dir = kernels / KERNEL
  spec_dir.mkdir(parents=True)
  spec = {
    "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
    "display_name": "tpu_embedding tests",
    "language": "python",
    "env": {
      "TPU_EMBEDDING_FAST": "1",
      "MPLBACKEND": "Agg",
      "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    },
  }
  (spec_dir / "kernel.json").write_text(json.dumps(spec))
  return KernelSpecManager(kernel_dirs=[str(kernels)])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, kernel_specs, tmp_path, monkeypatch):
  monkeypatch.setenv("TPU_EMBEDDING_OUTPUT_DIR", str(tmp_path / "output"))
  monkeypatch.delenv("MOVIELENS_DIR", raising=False)
  notebook = nbformat.read(path, as_version=4)
  manager = KernelManager(kernel_name=KERNEL, kernel_spec_manager=kernel_specs)
  client = nbclient.NotebookClient(
    notebook, km=manager, timeout=300, resources={"metadata": {"path": str(tmp_path)}}
  )
  client.execute()  # raises CellExecutionError, naming the cell, on any error
  outputs = "".join(
    o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.outputs
  )
  assert "Traceback" not in outputs
  if path.stem == "partial_tpu_embedding_dlrm":
    assert (tmp_path / "output" / "dlrm_training_loss.png").is_file()
    images = [
      o
      for c in notebook.cells
      if c.cell_type == "code"
      for o in c.outputs
      if "image/png" in o.get("data", {})
    ]
    assert images, "the loss plot is not displayed inline"
