"""The test base keras-rs's own tests import as `keras_rs.src.testing` (not in keras-rs's wheel).

Written for this project, with what the derived keras-rs tests use: a `unittest.TestCase` with
NumPy closeness checks and keras-rs's strategy (its `DummyStrategy` off TPU).
"""

from __future__ import annotations

import os
import unittest
from typing import Any

import keras
import numpy as np
from keras_rs.src.utils import tpu_test_utils


def uses_gpu() -> bool:
  """Whether Keras sees a GPU (keras-rs skips a few XLA cases there)."""
  return any(device.startswith("gpu") for device in keras.distribution.list_devices())


def _numpy(value: Any) -> np.ndarray:
  return value if isinstance(value, np.ndarray) else keras.ops.convert_to_numpy(value)


class TestCase(unittest.TestCase):
  """Fresh Keras state per test, keras-rs's strategy, and element-wise value checks."""

  def setUp(self) -> None:
    super().setUp()
    keras.utils.clear_session()
    self.on_tpu = "TPU_NAME" in os.environ

  @property
  def strategy(self) -> Any:
    return tpu_test_utils.get_shared_tpu_strategy()

  def assertAllClose(self, actual, desired, atol=1e-6, rtol=1e-6, msg="") -> None:
    np.testing.assert_allclose(_numpy(actual), _numpy(desired), atol=atol, rtol=rtol, err_msg=msg)

  def assertNotAllClose(self, actual, desired, atol=1e-6, rtol=1e-6, msg="") -> None:
    close = np.allclose(_numpy(actual), _numpy(desired), atol=atol, rtol=rtol)
    self.assertFalse(close, f"The two values are close at all elements. {msg}")

  def assertAllEqual(self, actual, desired, msg="") -> None:
    np.testing.assert_array_equal(_numpy(actual), _numpy(desired), err_msg=msg)
