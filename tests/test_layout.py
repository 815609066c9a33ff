"""The tests' own layout: a module's tests are found by its path, helpers and jobs apart, and
every test that starts a process is marked `integration` (left out by `make test-fast`).

`tests/<path>/test_<name>.py` tests `tpu_embedding/<path>/<name>.py` (or, for `examples/`,
`benchmarks/` and `colabs/`, the repository's own folder); `test_<folder>.py` tests a folder as a
whole. Every module has its test file, or a row of `TESTED_THROUGH` names the file that tests it
through its callers. Helpers live in `tests/support/`, scripts a child process runs in
`tests/jobs/`.
"""

import os
import re

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
HELPERS = ("support", "jobs")

# Tests of the package as a whole, or of one feature across modules, named after what they test.
ACROSS_MODULES = {
  "test_docs.py",
  "test_import_graph.py",
  "test_layout.py",
  "test_package.py",
  "test_multiworker.py",
  "test_parameter_server.py",
  "test_tfrs_compat.py",
  "test_tpu_harness.py",  # tests/support/tpu_harness.py against TF
  "engine/test_tracing.py",
  "keras/test_keras_rs_config_conversion.py",  # keras-rs's own tests, run against this package
  "keras/test_keras_rs_distributed_embedding.py",
  "managed_ids/test_distributed.py",
  "managed_ids/test_layers.py",
  "managed_ids/test_sharded.py",
  "managed_ids/test_tpu.py",
  "managed_ids/test_tpu_v0.py",
  "managed_ids/test_tpu_step_keys.py",
  "managed_ids/test_refused_calls.py",  # a refused call changes no map, on all five layers
  "preflight/test_jax_comparison.py",  # the statistics beside jax-tpu-embedding's host code
}

# Modules without a test file of their own, each tested through another: module -> test file.
TESTED_THROUGH = {
  # The mixins both Keras flavours of a layer share, tested as the tf-keras layer (and as Keras
  # 3's in tests/keras/).
  "tpu_embedding/layer_core.py": "tests/test_layer.py",
  "tpu_embedding/partial_core.py": "tests/test_partial.py",
  # Its one test needs that file's trained ranker (a module fixture) and NumPy lowering.
  "tpu_embedding/serving_error.py": "tests/test_quantization.py",
  # The engine's update of every table, against the float64 reference over whole steps.
  "tpu_embedding/engine/backward.py": "tests/engine/test_engine.py",
  # A layer's maps applied to its feature nest: meaningful only inside a layer.
  "tpu_embedding/managed_ids/tables.py": "tests/managed_ids/test_layer_mixin.py",
  # An abstract interface, tested through every path that implements it.
  "tpu_embedding/backends/base.py": "tests/backends/test_backends.py",
  # The CPU path is the engine behind the layer.
  "tpu_embedding/backends/cpu.py": "tests/engine/test_engine.py",
  # Resets of tables the Keras optimizer trains: TPU V0's (the parameter-server refusal in
  # tests/managed_ids/test_sharded.py).
  "tpu_embedding/backends/keras_trained.py": "tests/managed_ids/test_tpu_v0.py",
  # Each TPU path's reset writer (at once, deferred to flushes, routed by Partial's side).
  "tpu_embedding/backends/row_writers.py": "tests/managed_ids/test_tpu.py",
}


def _test_files() -> list[str]:
  found = []
  for folder, dirs, names in os.walk(TESTS):
    dirs[:] = [d for d in dirs if d != "__pycache__"]
    found += [
      os.path.relpath(os.path.join(folder, name), TESTS) for name in names if name.endswith(".py")
    ]
  return sorted(found)


FILES = _test_files()


def _tested(path: str) -> str:
  """The module or folder `tests/<path>` is named after, relative to the repository."""
  folder, name = os.path.split(path)
  name = name.removeprefix("test_").removesuffix(".py")
  top = folder.split(os.sep)[0]
  base = (
    folder if top in ("examples", "benchmarks", "colabs") else os.path.join("tpu_embedding", folder)
  )
  if folder and name == os.path.basename(folder):
    return base
  module = os.path.join(base, name + ".py")
  return module if folder or os.path.exists(os.path.join(ROOT, module)) else name + ".py"


def test_helpers_and_jobs_hold_no_tests_and_the_top_holds_no_helpers():
  assert [f for f in FILES if f.split(os.sep)[0] in HELPERS and "test_" in f] == []
  top = [f for f in FILES if os.sep not in f]
  assert [f for f in top if not f.startswith("test_") and f != "conftest.py"] == []


def test_a_test_file_mirrors_what_it_tests():
  named = [f for f in FILES if os.path.basename(f).startswith("test_") and f not in ACROSS_MODULES]
  assert [f for f in named if not os.path.exists(os.path.join(ROOT, _tested(f)))] == []


def _modules() -> list[str]:
  """Every module of the package but `__init__.py` and `__main__.py`, relative to the repository."""
  found = []
  for folder, dirs, names in os.walk(os.path.join(ROOT, "tpu_embedding")):
    dirs[:] = [d for d in dirs if d != "__pycache__"]
    found += [
      os.path.relpath(os.path.join(folder, name), ROOT)
      for name in names
      if name.endswith(".py") and name not in ("__init__.py", "__main__.py")
    ]
  return sorted(found)


def _mirror(module: str) -> str:
  """`tests/<path>/test_<name>.py` for `tpu_embedding/<path>/<name>.py`, relative to `tests/`."""
  folder, name = os.path.split(os.path.relpath(module, "tpu_embedding"))
  return os.path.join(folder, "test_" + name)


def test_every_module_has_its_mirrored_test_file_or_says_where_it_is_tested():
  missing = [m for m in _modules() if _mirror(m) not in FILES and m not in TESTED_THROUGH]
  assert missing == []
  assert [f for f in TESTED_THROUGH.values() if os.path.relpath(f, "tests") not in FILES] == []


def test_a_module_with_its_own_test_file_is_not_listed_as_tested_through_another():
  assert [m for m in TESTED_THROUGH if _mirror(m) in FILES] == []
  assert [m for m in TESTED_THROUGH if not os.path.exists(os.path.join(ROOT, m))] == []


def test_the_mirror_rule_reads_paths_as_documented():
  assert _tested("engine/test_lookup.py") == "tpu_embedding/engine/lookup.py"
  assert _tested("backends/test_backends.py") == "tpu_embedding/backends"
  assert _tested("test_config.py") == "tpu_embedding/config.py"
  assert _tested("test_build_backend.py") == "build_backend.py"
  assert _tested("examples/data/test_movielens.py") == "examples/data/movielens.py"
  assert _mirror("tpu_embedding/engine/lookup.py") == "engine/test_lookup.py"
  assert _mirror("tpu_embedding/config.py") == "test_config.py"


STARTS_A_PROCESS = re.compile(r"subprocess\.(run|Popen)|run_python\(|NotebookClient|LocalCluster\(")


def _starts_a_process_unmarked(path: str) -> bool:
  with open(os.path.join(TESTS, path)) as f:
    source = f.read()
  return bool(STARTS_A_PROCESS.search(source)) and "pytest.mark.integration" not in source


def test_a_test_that_starts_a_process_is_marked_integration():
  tests = [f for f in FILES if f.split(os.sep)[0] not in HELPERS and f != "test_layout.py"]
  assert [f for f in tests if _starts_a_process_unmarked(f)] == []
