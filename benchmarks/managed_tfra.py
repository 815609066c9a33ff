"""TensorFlow Recommenders-Addons' CPU dynamic embedding in the managed-ids benchmark's stress
model (the managed tables alone, one id a sample, a top MLP 64-1); its tables and optimizer are
TFRA's own (RandomNormal, TFRA's Adagrad wrapper at 0.05), not the workloads' RandomUniform and
legacy Adagrad 0.01.

Run by `python -m benchmarks managed` in its own environment (TFRA needs TensorFlow <= 2.16;
`TFRA_PYTHON` names that environment's interpreter), so it imports TensorFlow, tf-keras, TFRA
and NumPy only. Its tables are TFRA's unbounded hash tables (no capacity, no eviction): the
nearest TFRA configuration to a managed table; it prints one JSON line.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # TFRA 0.8's Keras layers are tf-keras ones

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tensorflow_recommenders_addons as tfra  # noqa: E402
import tf_keras  # noqa: E402

_MIX = np.uint64(0x9E3779B97F4A7C15)  # as benchmarks/managed_ids.py: Zipf ranks -> 64-bit keys


def main(settings: dict) -> dict:
  de = tfra.dynamic_embedding
  s = settings
  tables = [
    de.keras.layers.Embedding(
      s["dim"], key_dtype=tf.int64, initializer=tf.keras.initializers.RandomNormal(), name=f"t{i}"
    )
    for i in range(s["tables"])
  ]
  top = tf_keras.Sequential([tf_keras.layers.Dense(64, "relu"), tf_keras.layers.Dense(1)])
  optimizer = de.DynamicEmbeddingOptimizer(tf_keras.optimizers.Adagrad(0.05))

  @tf.function
  def step(inputs, labels):
    with tf.GradientTape() as tape:
      out = [table(inputs[i]) for i, table in enumerate(tables)]
      logits = top(tf.concat(out, 1))[:, 0]
      loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels, logits))
    variables = [v for x in tables + [top] for v in x.trainable_variables]
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
    return loss

  rng = np.random.default_rng(0)
  times = []
  for n in range(s["warmup"] + s["steps"]):
    inputs = []
    for _ in range(s["tables"]):
      ranks = (rng.zipf(1.1, size=s["batch"]).astype(np.uint64) - np.uint64(1)) % np.uint64(
        s["distinct"]
      )
      with np.errstate(over="ignore"):
        inputs.append(tf.constant((ranks * _MIX).view(np.int64)))
    labels = tf.constant(rng.integers(0, 2, s["batch"]).astype("f4"))
    start = time.perf_counter()
    step(inputs, labels).numpy()
    if n >= s["warmup"]:
      times.append(time.perf_counter() - start)
  size = int(sum(t.params.size() for t in tables))
  return dict(
    step_ms=1e3 * statistics.median(times), keys_held=size, tf=tf.__version__, tfra=tfra.__version__
  )


if __name__ == "__main__":
  print(json.dumps(main(json.loads(sys.argv[1]))))
