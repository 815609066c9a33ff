"""Test session setup: helpers on the path, quiet TensorFlow, and two logical CPU devices for
MirroredStrategy tests.

Logical devices can only be configured before TensorFlow initialises its runtime, so this runs
at import time, before any test module creates a tensor.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# Test helpers (tests/support) and the scripts child processes run (tests/jobs) are imported by
# their bare names from any test folder: `import reference`, `import sharded_job`.
_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(_TESTS, "support"), os.path.join(_TESTS, "jobs")]

import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
try:
  tf.config.set_logical_device_configuration(_cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
except RuntimeError:  # already initialised by an earlier import in this process
  pass


import pytest  # noqa: E402

from tpu_embedding.engine import native, static_path, updates  # noqa: E402


@pytest.fixture(params=["native", "tf_ops"])
def engine_path(request, monkeypatch) -> str:
  """Runs a test on the engine's compiled kernels and again on TF's own ops (its two paths)."""
  monkeypatch.setenv(native.ENV_SWITCH, "1" if request.param == "native" else "0")
  return request.param


@pytest.fixture(params=list(updates.XlaForm), ids=lambda form: form.name.lower())
def static_formulation(request, monkeypatch) -> updates.XlaForm:
  """Runs a test on each update formulation of the static-shape path, whatever the table's size
  (the whole table is what summed replicas take); rules that rewrite every row keep the whole
  table, the only formulation that serves them."""

  def forced(rule, *_):
    return updates.XlaForm.WHOLE_TABLE if rule.updates_every_row else request.param

  monkeypatch.setattr(static_path, "update_for", forced)
  return request.param
