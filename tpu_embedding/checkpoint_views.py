"""The names a `PartialTPUEmbedding`'s tables are saved under, whatever their side: this
package's (`<table>`, `<table>/<slot>` under `_tpu_embedding`) and the two of tf-recommenders'
`PartialTPUEmbedding` (`_tpu_embedding/_tpu_embedding/<table>` for a sharded table,
`_keras_embedding_layers/<feature>/embeddings` for a replicated one), so that its tables load
into that class too. Each is a view: a checkpoint stores a variable once, however many names
lead to it.
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from tpu_embedding import checkpoint_names, tf_internals


class CheckpointNode(tf_internals.AutoTrackable):
  """A node of the checkpoint's object graph whose children are named freely: table names,
  `<table>/<slot>` and feature paths, which need not be Python identifiers."""

  def add(self, name: str, child: Any) -> None:
    self._track_trackable(child, name=name, overwrite=True)


class PartialLayerViews:
  """The layer's checkpoint children that name its tables (see the module's docstring)."""

  def __init__(self):
    self._tables = CheckpointNode()
    self._tfrs_sharded = CheckpointNode()
    self._tfrs_keras_layers = CheckpointNode()

  def track(
    self, variables_by_table: dict[str, dict[str, tf.Variable]], features: Sequence[Any]
  ) -> None:
    """Names every table and slot of `variables_by_table` (the built ones) in every view."""
    for table_name, variables in variables_by_table.items():
      for key, variable in variables.items():
        self._tables.add(checkpoint_names.variable_key(table_name, key), variable)
      self._tfrs_sharded.add(table_name, variables[checkpoint_names.PARAMETERS])
    self._tables.add(checkpoint_names.TABLES_KEY, self._tfrs_sharded)
    for feature in features:
      if feature.table.name not in variables_by_table:
        continue
      keras_layer = CheckpointNode()
      keras_layer.add(
        checkpoint_names.TFRS_KERAS_EMBEDDINGS_KEY,
        variables_by_table[feature.table.name][checkpoint_names.PARAMETERS],
      )
      self._tfrs_keras_layers.add(feature.path, keras_layer)

  def children(self) -> dict[str, CheckpointNode]:
    """{checkpoint name: node}, for the layer's `_trackable_children`."""
    return {
      checkpoint_names.TABLES_KEY: self._tables,
      checkpoint_names.TFRS_KERAS_LAYERS_KEY: self._tfrs_keras_layers,
    }
