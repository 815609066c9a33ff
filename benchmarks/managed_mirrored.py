"""`python -m benchmarks.managed_mirrored SETTINGS_JSON`: the managed-ids DLRM step under
MirroredStrategy on 2 logical CPUs, raw keys inside the step (one map step per global batch,
the replicas' keys gathered), against the same model fed pre-mapped rows; batches interleaved,
medians. Prints one JSON line. Its own process: logical devices exist only if they are set
before TensorFlow starts, and the other timings of `python -m benchmarks managed` run on one.
"""

from __future__ import annotations

import json
import os
import sys

import tensorflow as tf
import tf_keras

from benchmarks import managed_ids


def mirrored_step(strategy: tf.distribute.Strategy, s: dict, managed: bool):
  """The workload's step under `strategy`: each replica trains its share of the global batch
  (cut inside the step, the same for both variants), the loss summed over the global batch."""
  with strategy.scope():
    layer, (bottom, top, _), optimizer = managed_ids.model_parts(s, managed)
  if managed:
    managed_ids.fill(layer, s)
  per_example = tf_keras.losses.BinaryCrossentropy(from_logits=True, reduction="none")
  loss = lambda y, logits: tf.reduce_sum(per_example(y, logits)) / s["batch"]  # global mean
  parts = (layer, (bottom, top, loss), optimizer)

  def replica_step(inputs, dense, labels):
    context = tf.distribute.get_replica_context()
    share = s["batch"] // context.num_replicas_in_sync
    first = context.replica_id_in_sync_group * share
    cut = tf.nest.map_structure(lambda t: t[first : first + share], (inputs, dense, labels))
    return managed_ids.train_step(parts, s, *cut)

  @tf.function
  def step(inputs, dense, labels):
    losses = strategy.run(replica_step, args=(inputs, dense, labels))
    return strategy.reduce("SUM", losses, axis=None)

  return step


def main(s: dict) -> dict:
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
  strategy = tf.distribute.MirroredStrategy(
    ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
  )
  data = list(managed_ids.batches(s, s["warmup"] + s["steps"], seed=0))
  premapped, managed = mirrored_step(strategy, s, False), mirrored_step(strategy, s, True)
  variants = {
    "premapped": lambda raw, ranks, x, y: premapped(ranks, x, y),
    "managed": lambda raw, ranks, x, y: managed(raw, x, y),
  }
  times = {name: [] for name in variants}
  for i, batch in enumerate(data):
    for name, fn in variants.items():
      took = managed_ids.timed(fn, *batch)
      if i >= s["warmup"]:
        times[name].append(took)
  return dict(load_average=os.getloadavg(), **managed_ids.summary(times))


if __name__ == "__main__":
  print(json.dumps(main(json.loads(sys.argv[1]))))
