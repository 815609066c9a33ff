"""The README and docs/: a short guide, code that uses only the public surface, links that hold.

The code of docs/checkpoints-and-serving.md is run by tests/test_serving.py; here every Python
block of every page is read for what it imports.
"""

import ast
import glob
import os
import re

import pytest

import tpu_embedding
import tpu_embedding.keras
import tpu_embedding.preflight

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
PUBLIC_MODULES = {"tpu_embedding", "tpu_embedding.keras", "tpu_embedding.preflight"}


def _read(path: str) -> str:
  with open(path) as f:
    return f.read()


def python_blocks(path: str) -> list[str]:
  return re.findall(r"```python\n(.*?)```", _read(path), re.S)


def test_the_readme_is_a_short_guide_with_the_quick_start_on_its_first_screen():
  text = _read(os.path.join(ROOT, "README.md"))
  lines = text.splitlines()
  assert len(lines) < 200
  # Measurements and run logs live in benchmarks/results/ (docs/performance.md), not here.
  assert re.findall(r"`[0-9a-f]{7,40}`", text) == []
  assert "## Quick start" in lines[:40]
  assert "make demo" in "\n".join(lines[:40]) and "make test" in "\n".join(lines[:40])


DEPRECATED = {"Path"}  # documented as the former name of ExecutionPath; still works, and warns


def _exported(module: str, name: str) -> bool:
  if module == "tpu_embedding":
    return name in tpu_embedding.__all__ or name in DEPRECATED or name == "keras"
  if module == "tpu_embedding.preflight":
    return name in tpu_embedding.preflight.__all__
  return module == "tpu_embedding.keras" and name in tpu_embedding.keras.__all__


@pytest.mark.parametrize("page", PAGES, ids=os.path.basename)
def test_snippets_import_only_the_public_surface(page):
  for block in python_blocks(page):
    for node in ast.walk(ast.parse(block)):
      if isinstance(node, ast.ImportFrom) and node.module.startswith("tpu_embedding"):
        for alias in node.names:
          assert _exported(node.module, alias.name), f"from {node.module} import {alias.name}"
      elif isinstance(node, ast.Import):
        for alias in node.names:
          if alias.name.startswith("tpu_embedding"):
            assert alias.name in PUBLIC_MODULES, f"import {alias.name}"


@pytest.mark.parametrize("page", PAGES, ids=os.path.basename)
def test_names_used_through_the_package_are_exported(page):
  """`tpu_embedding.<name>` in the text is a public name (commands run `python -m` on the
  examples, which are programs, not names to import)."""
  text = _read(page)
  for module, name in re.findall(r"(tpu_embedding(?:\.keras|\.preflight)?)\.(\w+)", text):
    if name != "examples" and not (module == "tpu_embedding" and name in ("keras", "preflight")):
      assert _exported(module, name), f"{os.path.basename(page)}: {module}.{name}"


@pytest.mark.parametrize("page", PAGES, ids=os.path.basename)
def test_relative_links_reach_a_page(page):
  for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", _read(page)):
    path = os.path.normpath(os.path.join(os.path.dirname(page), target))
    assert os.path.exists(path), target
