"""ParameterServerStrategy for real: tables on a ps task, steps scheduled on two workers.

The cluster runs in a subprocess (`tests/jobs/parameter_server_job.py`), since connecting to a
cluster changes
TensorFlow's global context, in a network of its own where one can be made. Expected values are
worked out by hand from the job's batches (see its docstring for why they do not depend on the order
the workers run steps in).
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import loopback

pytestmark = pytest.mark.integration  # starts processes (make test-fast leaves it out)

JOB = pathlib.Path(__file__).parent / "jobs" / "parameter_server_job.py"


def _adagrad_step(row, accumulator, gradient):
  """One Adagrad step of the spec (no epsilon), lr 0.5, in float64."""
  accumulator = accumulator + gradient**2
  return row - 0.5 * gradient / np.sqrt(accumulator), accumulator


def test_tables_on_a_parameter_server_are_trained_by_the_engine(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
  with loopback.network() as network:
    result = subprocess.run(
      network.command([sys.executable, str(JOB), str(tmp_path / "out.npz")]),
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
    )
  assert result.returncode == 0, result.stderr[-3000:]
  out = np.load(tmp_path / "out.npz")
  assert "/job:ps/" in str(out["placement"][0])
  # Updates that hold the variables' locks (TF's; the compiled kernels may not be loaded on ps).
  assert {"ResourceScatterSub", "ResourceSparseApplyAdagradV2"} <= set(out["op_types"])
  assert not [op for op in out["op_types"] if op.startswith("TpuEmbedding")]

  # Feature "a" (SGD, lr 0.5, loss weight 1): each occurrence of a row subtracts 0.5 from it.
  occurrences = np.array([3, 1, 4, 1, 0, 3], np.float32)  # rows 0..5 over the four batches
  np.testing.assert_array_equal(out["sgd"], -0.5 * np.repeat(occurrences[:, None], 2, axis=1))

  # Feature "b" (Adagrad, accumulators from 1, loss weight 2): per step a row's gradient is
  # 2 x its count in the batch. Rows 0: [2]; 1: [2, 2]; 2: none; 3: [4]; 4: [2, 4] (either order).
  np.testing.assert_array_equal(
    out["accumulators"][:, 0], [1 + 4, 1 + 4 + 4, 1, 1 + 16, 1 + 4 + 16]
  )

  # Both columns get the same update, and column 1 starts 1 above column 0.
  def trained(row, gradients):
    value, accumulator = 2.0 * row, 1.0
    for g in gradients:
      value, accumulator = _adagrad_step(value, accumulator, g)
    return [value, value + 1]

  for row, gradients in {0: [2], 1: [2, 2], 2: [], 3: [4]}.items():
    np.testing.assert_allclose(out["adagrad"][row], trained(row, gradients), rtol=1e-6)
  assert any(
    np.allclose(out["adagrad"][4], trained(4, order), rtol=1e-6) for order in ([2, 4], [4, 2])
  ), out["adagrad"][4]
