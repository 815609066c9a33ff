"""`MapTable`: TF's hash table of one map, saved from the map's variables.

A map on the compiled kernels keeps its key -> row table in the kernel's index (a cache of the
variables, ~4x smaller than TF's node-based table) and leaves this one empty; a map on TF's ops
(no kernels, or its variables on another task) keeps this one filled. Either way checkpoints and
SavedModels hold the same pairs, taken from the variables, so a SavedModel's table (read by
processes that import only TensorFlow) is whole, and a checkpoint restores into either kind.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from tpu_embedding import tf_internals

# The map's (keys, rows) of every key holding a row, read from its variables.
Pairs = Callable[[], tuple[tf.Tensor, tf.Tensor]]


class MapTable(tf.lookup.experimental.MutableHashTable):
  """A `MutableHashTable(key -> int64 row, default 0)` whose checkpoint entries come from
  `pairs()` and are restored into it only where `filled()` (the map reads this table)."""

  def __init__(self, key_dtype: tf.DType, pairs: Pairs, filled: Callable[[], bool]):
    super().__init__(key_dtype, tf.int64, 0)
    self._pairs = pairs
    self._filled = filled

  def _serialize_to_tensors(self) -> dict[str, tf.Tensor]:
    # Traced for a SavedModel's own save function, the table is that of the loaded SavedModel,
    # always filled; the map's variables may not be part of what is saved.
    if in_save_trace():
      return super()._serialize_to_tensors()
    keys, rows = self._pairs()
    return {"-keys": keys, "-values": rows}

  def _restore_from_tensors(self, restored_tensors: dict[str, tf.Tensor]):
    # Traced for a SavedModel's restore function, it fills the loaded table.
    if not (self._filled() or in_save_trace()):
      return tf.no_op()
    return super()._restore_from_tensors(restored_tensors)


def in_save_trace() -> bool:
  """Whether a SavedModel's functions are being traced (not a checkpoint written or read in a
  `tf.function`, which runs here and reads the map's variables)."""
  return tf_internals.in_save_context() and not tf.executing_eagerly()
