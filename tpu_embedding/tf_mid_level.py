"""The one place that reaches into TensorFlow's mid-level TPU embedding objects.

Checked against the TensorFlow versions in `CHECKED_AGAINST` (`tf_versions`; importing this
module under another raises `tf_versions.UncheckedTensorFlow`). TF has no public way to:
- reach the dict `TPUEmbeddingV0` and `TPUEmbedding` (V1) keep their variables in,
  {table name: {"parameters" or slot name: variable}}, which they set as `_variables` when
  built: their public `embedding_tables` gives copies of the tables only (V1's refuses on a TPU
  outside a checkpoint save), while the layer needs the slots too (checkpoint validation,
  export) and replaces a table by writing into this dict, which the class reads on every lookup
  (`update_embedding_table`, as tf-recommenders does). `TPUEmbeddingV2` gives the same dict
  publicly (its `variables`), so it is not read here;
- copy V1's tables and slots from TPU memory into their host variables, which TF does only in
  its checkpoint-save callback, through `_retrieve_variables`, or back into TPU memory, which
  TF does when built and after a restore, through `_load_variables` (managed ids reset rows
  given to new keys in the host copies and load them);
- tell the variables TF's TPU classes split a table into (V1's `TPUEmbeddingVariable`, one
  variable per host; SparseCore's `TPUEmbeddingShardedVariable`, one per device) from any other:
  their pieces are public (`variables`, `values`), the classes are not exported. Keras's legacy
  HDF5 files store these pieces (`weight_files`).
`tests/test_tf_mid_level.py` runs both on the real classes (TPU runtime stubbed), so a TF
upgrade that moves either fails there rather than in a user's model.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.tpu import tpu_embedding_v2

from tpu_embedding import tf_versions

try:  # TF 2.16 on: SparseCore's sharded variables.
  from tensorflow.python.tpu import tpu_embedding_v3
except ImportError:  # TF 2.15 has no SparseCore, so no table is split per device.
  tpu_embedding_v3 = None

CHECKED_AGAINST = tf_versions.CHECKED_AGAINST
tf_versions.require_checked(__name__)


def variables_by_table(mid_level: tf.Module) -> dict[str, dict[str, tf.Variable]]:
  """The built mid-level object's own {table name: {"parameters"/slot: variable}}: editing it
  edits what the object looks up and trains."""
  return mid_level._variables


def retrieve_from_tpu(mid_level: tf.Module) -> None:
  """Copies V1's tables and slots from TPU memory into their host variables, as a save does."""
  mid_level._retrieve_variables()


def load_into_tpu(mid_level: tf.Module) -> None:
  """Copies V1's host tables and slots into TPU memory, as a build or a restore does."""
  mid_level._load_variables()


def plain_variables(variable: tf.Variable) -> list[tf.Variable]:
  """The plain variables holding one table or slot: V1's per-host shards, SparseCore's per-device
  shards, or on every other path the variable itself."""
  if isinstance(variable, tpu_embedding_v2.TPUEmbeddingVariable):
    return list(variable.variables)
  if tpu_embedding_v3 is not None and isinstance(
    variable, tpu_embedding_v3.TPUEmbeddingShardedVariable
  ):
    return list(variable.values)
  return [variable]
