"""`TPUEmbedding` for tf-keras: the Keras layer users put in their models, a thin shell.

The execution path is decided once, at construction, from the strategy in scope
(`tpu_embedding.hardware`); everything path-specific lives in `tpu_embedding.backends`, and
everything the layer does in `tpu_embedding.layer_core`, shared with the Keras 3 layer
(`tpu_embedding.keras`).
"""

from __future__ import annotations

import warnings
from typing import Any

import tf_keras

from tpu_embedding import hardware, weight_files
from tpu_embedding.layer_core import TPUEmbeddingCore

_RELOAD_REFUSAL = (
  "A model holding a {layer} layer cannot be rebuilt by tf_keras.models.load_model: the "
  "rebuilt model would no longer train its embedding tables (their feature configuration and "
  "optimizers are not part of a Keras config). Instead, build the model in code as before and "
  "restore its state with tf.train.Checkpoint(model=model).restore(path) (saved with "
  "tf.train.Checkpoint(model=model).save(path)), or, for a file model.save wrote (.h5, "
  ".keras), with model.load_weights(path), which restores every table and slot it holds; to "
  "serve it, export it with tpu_embedding.serving.export_for_serving and load that with "
  "tf.saved_model.load."
)


class RebuiltInCodeOnly:
  """The Keras config of a tf-keras embedding layer: its name only, and a refusal to rebuild.

  `model.save` (HDF5, `.keras`, SavedModel) writes the config; `load_model` then reaches
  `from_config`, which refuses with the way to save and restore instead of reviving a shell
  whose tables nothing trains. The tables and slots themselves are in every such file, for
  `model.load_weights` into a model built in code.
  """

  # Makes load_model rebuild the layer through `from_config` (see above), even from a SavedModel.
  _must_restore_from_config = True

  def get_config(self) -> dict[str, Any]:
    return {"name": self.name, "trainable": self.trainable}

  @classmethod
  def from_config(cls, config: dict[str, Any]) -> Any:
    raise ValueError(_RELOAD_REFUSAL.format(layer=cls.__name__))


@tf_keras.saving.register_keras_serializable(package="tpu_embedding")
class TPUEmbedding(
  RebuiltInCodeOnly,
  weight_files.TablesInKerasFiles,
  TPUEmbeddingCore,
  tf_keras.layers.Layer,
):
  """Embedding lookups for large tables, trained as the TPU embedding engine trains them.

  A drop-in replacement for `tfrs.layers.embedding.TPUEmbedding` (same arguments, same call).

  Args:
    feature_config: any nest of `tf.tpu.experimental.embedding.FeatureConfig`.
    optimizer: for every table without its own `TableConfig.optimizer`: a string, a Keras
      optimizer of any family, or a `tf.tpu.experimental.embedding` optimizer. None is for
      serving-only layers (no slot variables), refused on the TPU embedding engines (V1, V2).
      On a TPU without embedding hardware (V0) the Keras optimizer the model applies trains the
      tables, so mid-level optimizers are refused there (docs/tpu-paths.md).
    pipeline_execution_with_tensor_core: overlap embedding and dense work on TPU; on CPU the
      same one-step-stale lookups are emulated so its effect can be measured before paying.
    batch_size: per-replica batch size for building the TPU V1 engine (deprecated by TF).
    embedding_feature: force a TPU embedding feature (`UNSUPPORTED` is always allowed).
    sparse_core_embedding_config: passed to `TPUEmbeddingV2` on SparseCore.
    table_updates: off TPU, "engine" (default) trains tables with each table's mid-level
      optimizer exactly as the TPU does; "keras" makes the tables trainable variables updated by
      the Keras optimizer the user applies (the tf-recommenders behaviour).
    check_finite: off TPU, raise an error naming the feature or table at the first NaN/Inf
      gradient, weight or learning rate on its way to a table, before anything is written.
      Off by default, as on TPU, where such values silently poison the rows they touch.
  """

  @property
  def non_trainable_weights(self) -> list:
    """Keras's list, which on CPU/GPU holds the engine's tables and slots, and on TPU V1/V2 the
    pieces of the TPU's tables (`weight_files`), which Keras does not find itself. Reading it
    changes nothing: V1's pieces hold the TPU's memory after `flush` (Keras's legacy HDF5 files,
    which store this list, say so in docs/checkpoints-and-serving.md)."""
    weights = super().non_trainable_weights
    if self.built and self.execution_path in weight_files.IN_TPU_MEMORY:
      weights += list(self.table_weights(self.variables_by_table).values())
    return weights

  @property
  def path(self) -> hardware.ExecutionPath:
    """Deprecated: `execution_path` (Keras 3 layers have a `path` of their own, their name)."""
    warnings.warn(
      "TPUEmbedding.path is deprecated; use TPUEmbedding.execution_path.",
      DeprecationWarning,
      stacklevel=2,
    )
    return self.execution_path
