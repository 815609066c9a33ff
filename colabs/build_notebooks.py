"""Writes the colabs (nbformat v4, no outputs) from their sources in `colabs/notebooks/`.

    .venv/bin/python colabs/build_notebooks.py

Each notebook is a Python file in the percent format: `# %%` starts a code cell,
`# %% [markdown]` a Markdown cell whose lines are comments (`# ` stripped), and a code line
`# %magic` is the IPython magic `%magic`. Edit the sources, not the notebooks, so that the code
stays reviewable and ruff checks it; `tests/colabs/test_colabs.py` checks the notebooks match their
sources and runs every notebook top to bottom in fast mode.
"""

from __future__ import annotations

import glob
import os
import re

import nbformat

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = os.path.join(HERE, "notebooks")

_CELL = re.compile(r"^# %%( \[markdown\])?$", re.M)


def cells_of(source: str) -> list[nbformat.NotebookNode]:
  """The notebook cells a percent-format source describes."""
  markers = list(_CELL.finditer(source))
  if not markers or source[: markers[0].start()].strip():
    raise ValueError("a notebook source must start with a `# %%` cell marker")
  cells = []
  for marker, following in zip(markers, markers[1:] + [None]):
    body = source[marker.end() : following.start() if following else len(source)].strip("\n")
    if marker.group(1):
      lines = [re.sub(r"^# ?", "", line) for line in body.split("\n")]
      cells.append(nbformat.v4.new_markdown_cell("\n".join(lines)))
    else:
      cells.append(nbformat.v4.new_code_cell(re.sub(r"^# (%\w)", r"\1", body, flags=re.M)))
  return cells


def notebooks() -> dict[str, list[nbformat.NotebookNode]]:
  """{notebook file name: its cells}, one per source in `colabs/notebooks/`."""
  result = {}
  for path in sorted(glob.glob(os.path.join(SOURCES, "*.py"))):
    with open(path, encoding="utf-8") as f:
      name = os.path.splitext(os.path.basename(path))[0] + ".ipynb"
      result[name] = cells_of(f.read())
  return result


NOTEBOOKS = notebooks()


def build(directory: str = HERE) -> list[str]:
  paths = []
  for name, cells in NOTEBOOKS.items():
    notebook = nbformat.v4.new_notebook(cells=cells)
    for number, cell in enumerate(notebook.cells):
      cell.id = f"cell-{number}"  # stable ids: rebuilding changes nothing unless a cell does
    notebook.metadata["kernelspec"] = {
      "name": "python3",
      "display_name": "Python 3",
      "language": "python",
    }
    notebook.metadata["language_info"] = {"name": "python"}
    nbformat.validate(notebook)
    path = os.path.join(directory, name)
    with open(path, "w", encoding="utf-8") as f:
      nbformat.write(notebook, f)
    paths.append(path)
  return paths


if __name__ == "__main__":
  for written in build():
    print(written)
