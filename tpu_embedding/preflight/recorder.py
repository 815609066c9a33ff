"""SparseCore statistics gathered while a layer trains off TPU (`layer.sparse_core_stats()`):
each lookup's ids are handed to the host, where `input_stats.Collector` counts them as
`sparse_core_stats` would.

Each call's features are read as one global batch on `num_chips` chips: call the layer with the
global batch (off a distribution strategy) for TPU-like figures. Batches whose size differs from
the first's (a last partial batch) are skipped and counted, as a TPU run needs equal batches.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf
from absl import logging

from tpu_embedding import tf_internals
from tpu_embedding.preflight import input_stats
from tpu_embedding.preflight import routing as routing_lib


class StatsRecorder:
  """Counts the ids of every lookup a layer makes, for one chip count."""

  def __init__(
    self,
    feature_config: Any,
    optimizer: Any,
    *,
    num_chips: int,
    sparse_cores_per_chip: int = 4,
    stacking: bool = True,
  ):
    routing_lib.validate_chips(num_chips, sparse_cores_per_chip)
    self._feature_config = feature_config
    self._optimizer = optimizer
    self._chips = num_chips
    self._cores = sparse_cores_per_chip
    self._stacking = stacking
    self._collector = None
    self.batches = 0
    self.skipped = 0

  def record(self, features: Any) -> None:
    """Hands `features` (the layer's input nest) to the host to be counted; in a graph, a
    stateful op that automatic control dependencies run."""
    if tf_internals.compiling_with_xla():
      raise ValueError(
        "sparse_core_stats collection runs on the host and cannot be compiled by XLA: "
        "train without jit_compile while collecting."
      )
    parts, kinds = [], []
    for value in tf_internals.flatten_up_to(self._feature_config, features):
      if isinstance(value, tf.RaggedTensor):
        parts += [value.flat_values, value.row_splits]
        kinds.append("ragged")
      elif isinstance(value, tf.SparseTensor):
        parts += [value.indices, value.values, value.dense_shape]
        kinds.append("sparse")
      else:
        parts.append(tf.convert_to_tensor(value))
        kinds.append("dense")
    tf.numpy_function(lambda *arrays: self._add(kinds, arrays), parts, [], stateful=True)

  def _add(self, kinds: list[str], arrays: tuple[np.ndarray, ...]) -> list:
    values, position = [], 0
    for kind in kinds:
      if kind == "ragged":
        values.append(tf.RaggedTensor.from_row_splits(*arrays[position : position + 2]))
        position += 2
      elif kind == "sparse":
        values.append(tf.SparseTensor(*arrays[position : position + 3]))
        position += 3
      else:
        values.append(arrays[position])
        position += 1
    batch = tf.nest.pack_sequence_as(self._feature_config, values)
    if self._collector is None:
      self._collector = input_stats.Collector(
        routing_lib.routing(
          self._feature_config,
          batch,
          num_chips=self._chips,
          sparse_cores_per_chip=self._cores,
          stacking=self._stacking,
          optimizer=self._optimizer,
        )
      )
    expected = [route.samples_per_chip * self._chips for route in self._collector.route.features]
    if [routing_lib.sample_count(v) for v in values] != expected:
      self.skipped += 1
      logging.warning("sparse_core_stats: skipped a batch of another size than the first's.")
      return []
    self._collector.add(values)
    self.batches += 1
    return []

  def result(self) -> dict[str, Any]:
    """What `sparse_core_stats` returns for the batches recorded so far."""
    if self._collector is None:
      raise ValueError("No batch has been recorded yet: call the layer (train) first.")
    return self._collector.result()
