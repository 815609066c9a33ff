"""The gradient-trap race, repeated over fresh traces: does a table's update read the next
layer's kernel before the same step's optimizer updates it?

With a loss linear in the activations, their gradient is a read of the dense kernel, and until
2026-11-24 grappler let the kernel's update run first in about 1 trace in 3
(docs/development.md, "The gradient trap and grappler"). Each run builds a new layer, model
and `tf.function`, trains two steps and compares the row and the kernel with NumPy's.
`tests/test_trap.py` runs a few traces; this runs as many as asked.

Usage: python -m benchmarks.trap_race [runs]   (default 100; prints the runs that differed)
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
import tf_keras

import tpu_embedding

E = tf.tpu.experimental.embedding
KERNEL_LAYER = "kernel_layer"
RATES = (1.0, 0.25)  # the two steps' learning rates


def linear_step(optimizer, jit_compile: bool = False, inner_function: bool = False) -> tuple:
  """(layer, its table config, the dense layer, a step training both with a linear loss).

  With `inner_function`, the layer is called inside a `tf.function` of its own, whose backward
  function TF traces and calls inside the step.
  """
  table = E.TableConfig(3, 2, initializer=tf.zeros_initializer(), name="t")
  layer = tpu_embedding.TPUEmbedding(E.FeatureConfig(table=table), optimizer)
  dense = tf_keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", name=KERNEL_LAYER)
  embed = tf.function(layer) if inner_function else layer

  @tf.function(jit_compile=jit_compile)
  def step(ids):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(dense(embed(ids)))
    variables = layer.trainable_variables + dense.trainable_variables
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))

  return layer, table, dense, step


def expected_row_and_kernel() -> tuple[np.ndarray, np.ndarray]:
  """NumPy's row 1 and kernel after the steps of `trained_row_and_kernel`: the row's gradient
  is the kernel read before the step's update, the kernel's is that row read in the forward."""
  row, kernel = np.zeros(2), np.ones(2)
  for rate in RATES:
    row, kernel = row - rate * kernel, kernel - rate * row
  return row, kernel


def trained_row_and_kernel(jit_compile: bool = False) -> tuple[np.ndarray, np.ndarray]:
  """Row 1 and the kernel after two steps of a fresh layer, model and trace (rates `RATES`)."""
  schedule = tf_keras.optimizers.schedules.PiecewiseConstantDecay([0], list(RATES))
  layer, table, dense, step = linear_step(tf_keras.optimizers.SGD(schedule), jit_compile)
  for _ in RATES:
    step(tf.constant([1]))
  return layer.embedding_tables[table].numpy()[1], dense.kernel.numpy()[:, 0]


def main(runs: int) -> int:
  """Runs the race `runs` times; returns how many runs differed from NumPy."""
  expected = expected_row_and_kernel()
  differed = 0
  for _ in range(runs):
    got = trained_row_and_kernel()
    differed += not all(np.allclose(g, e) for g, e in zip(got, expected))
  print(f"{differed} of {runs} fresh traces differed from NumPy {expected}")
  return differed


if __name__ == "__main__":
  sys.exit(1 if main(int(sys.argv[1]) if len(sys.argv) > 1 else 100) else 0)
