"""Importing one Keras flavour of the layer never loads the other Keras.

Each import runs in a fresh interpreter and reads `sys.modules`. TensorFlow itself imports
Keras 3 (for `tf.keras`), so "no Keras 3" means no Keras 3 module beyond those TensorFlow loads.
"""

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from tpu_embedding import tf_versions

pytestmark = pytest.mark.integration  # starts processes (make test-fast leaves it out)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def loaded_after(statement: str) -> dict:
  """{"tf_keras": bool, "new_keras": [Keras 3 modules loaded beyond `import tensorflow`]}."""
  code = (
    "import json, sys\n"
    "import tensorflow\n"
    "def keras3(): return {m for m in sys.modules if m == 'keras' or m.startswith('keras.')}\n"
    "before = keras3()\n"
    f"{statement}\n"
    "print(json.dumps({'tf_keras': 'tf_keras' in sys.modules,\n"
    "                  'new_keras': sorted(keras3() - before)}))\n"
  )
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")
  result = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
  not tf_versions.supports_keras(importlib.metadata.version("keras")),
  reason="tpu_embedding.keras refuses this Keras (tests/test_tf_versions.py)",
)
def test_keras3_layers_and_the_package_do_not_import_tf_keras():
  loaded = loaded_after(
    "import tpu_embedding\n"
    "assert 'tf_keras' not in sys.modules, 'import tpu_embedding loads tf_keras'\n"
    "import tpu_embedding.keras\n"
    "from tpu_embedding import serving"
  )
  assert not loaded["tf_keras"]


def test_tf_keras_layers_do_not_import_more_keras3():
  loaded = loaded_after(
    "import tpu_embedding\ntpu_embedding.TPUEmbedding, tpu_embedding.PartialTPUEmbedding"
  )
  assert loaded["tf_keras"]  # the check below looks at a process that did load tf-keras
  assert loaded["new_keras"] == []


def test_top_level_names_are_imported_on_first_use():
  import tpu_embedding
  from tpu_embedding import layer, partial

  assert tpu_embedding.TPUEmbedding is layer.TPUEmbedding
  assert tpu_embedding.PartialTPUEmbedding is partial.PartialTPUEmbedding
  assert set(tpu_embedding.__all__) <= set(dir(tpu_embedding))
  with pytest.raises(AttributeError, match="no attribute 'Missing'"):
    tpu_embedding.Missing


def test_the_old_name_path_warns_and_gives_execution_path():
  import tpu_embedding
  from tpu_embedding import hardware

  assert tpu_embedding.ExecutionPath is hardware.ExecutionPath
  with pytest.warns(DeprecationWarning, match=r"tpu_embedding.Path is deprecated; use .*Exec"):
    assert tpu_embedding.Path is hardware.ExecutionPath
  assert "Path" not in tpu_embedding.__all__
