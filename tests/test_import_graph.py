"""The package's import arrows point down: layers -> dispatch -> engine -> configuration.

Read from the source (every `import` statement, at any depth, followed transitively inside the
package), so an arrow added in a function body counts as much as one at the top.
"""

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tpu_embedding")


def _module_files() -> dict[str, str]:
  files = {}
  for folder, _, names in os.walk(PACKAGE):
    for name in names:
      if not name.endswith(".py"):
        continue
      relative = os.path.relpath(os.path.join(folder, name), os.path.dirname(PACKAGE))
      module = relative[: -len(".py")].replace(os.sep, ".")
      files[module.removesuffix(".__init__")] = os.path.join(folder, name)
  return files


FILES = _module_files()


def imported_names(module: str) -> set[str]:
  """Every absolute name `module` imports (`from package import module` as both names)."""
  with open(FILES[module]) as f:
    tree = ast.parse(f.read())
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      found.add(node.module)
      found.update(f"{node.module}.{alias.name}" for alias in node.names)
  return found


def direct_imports(module: str) -> set[str]:
  """The package modules `module` imports."""
  return {name for name in imported_names(module) if name in FILES} - {module}


def test_the_package_holds_the_library_and_no_example():
  """Demos, their data and the cluster launcher live in the root's examples/, outside the wheel."""
  assert [m for m in FILES if m.split(".")[1:2] in (["examples"], ["data"])] == []
  uses = sorted(m for m in FILES if any(n.split(".")[0] == "examples" for n in imported_names(m)))
  assert uses == []
  assert os.path.isfile(os.path.join(os.path.dirname(PACKAGE), "examples", "movielens_ranking.py"))


def reachable(module: str) -> set[str]:
  """Every package module importing `module` loads, itself excluded; packages on the way
  (`tpu_embedding.engine` for `tpu_embedding.engine.x`) are loaded too."""
  seen, todo = set(), [module]
  while todo:
    for name in direct_imports(todo.pop()):
      parts = name.split(".")
      for parent in (".".join(parts[:i]) for i in range(2, len(parts) + 1)):
        if parent in FILES and parent not in seen:
          seen.add(parent)
          todo.append(parent)
  seen.discard(module)
  return seen


def test_reachable_follows_imports_transitively():
  # The engine module itself reaches its own package's modules and the configuration.
  below_engine = reachable("tpu_embedding.engine.engine")
  assert {"tpu_embedding.engine.updates", "tpu_embedding.config"} <= below_engine
  assert "tpu_embedding.layer_core" not in below_engine


ENGINE_OR_LAYERS = (
  "tpu_embedding.engine",
  "tpu_embedding.backends",
  "tpu_embedding.layer",
  "tpu_embedding.layer_core",
  "tpu_embedding.partial",
  "tpu_embedding.partial_core",
  "tpu_embedding.keras",
  "tpu_embedding.serving",
)


@pytest.mark.parametrize(
  "module",
  [m for m in FILES if m.startswith("tpu_embedding.config")]
  + ["tpu_embedding.optimizers", "tpu_embedding.optimizer_specs"],
)
def test_configuration_and_optimizers_import_no_engine_or_layer(module):
  upward = sorted(
    name
    for name in reachable(module)
    if any(name == top or name.startswith(top + ".") for top in ENGINE_OR_LAYERS)
  )
  assert upward == [], f"{module} imports {upward}"


def test_optimizer_descriptions_import_nothing_of_the_package_but_the_tf_adapter():
  # TF's private slot names are read through the version-checked adapter, itself a leaf
  # (`from tpu_embedding import tf_internals` names the package too; its names load lazily).
  package = {"tpu_embedding"}
  assert direct_imports("tpu_embedding.optimizer_specs") - package <= {"tpu_embedding.tf_internals"}
  assert direct_imports("tpu_embedding.tf_internals") - package <= {"tpu_embedding.tf_versions"}
  assert direct_imports("tpu_embedding.tf_versions") == set()


def _calls(module: str, name: str) -> list[int]:
  with open(FILES[module]) as f:
    tree = ast.parse(f.read())
  return [
    node.lineno
    for node in ast.walk(tree)
    if isinstance(node, ast.Call)
    and name in (getattr(node.func, "attr", None), getattr(node.func, "id", None))
  ]


def test_the_hardware_is_asked_once_per_layer():
  """`PartialTPUEmbedding` takes the path from `placement` and hands it to its sharded layer."""
  assert _calls("tpu_embedding.partial_core", "choose_path") == []
  assert len(_calls("tpu_embedding.placement", "choose_path")) == 1
  assert len(_calls("tpu_embedding.layer_core", "choose_path")) == 1


LAYERS = [
  m
  for m in FILES
  if m in ("tpu_embedding.layer_core", "tpu_embedding.partial_core")
  or m in ("tpu_embedding.layer", "tpu_embedding.partial")
  or m.startswith("tpu_embedding.keras")
]


@pytest.mark.parametrize("module", LAYERS)
def test_layers_use_the_engine_through_its_declared_api(module):
  inside = sorted(
    name for name in direct_imports(module) if name.startswith("tpu_embedding.engine.")
  )
  assert inside == [], f"{module} imports {inside}; use tpu_embedding.engine's names"
