"""`TPUEmbedding` for Keras 3 (TensorFlow backend): the tf-keras layer's logic over a Keras 3 base.

Everything the layer does is `tpu_embedding.layer_core.TPUEmbeddingCore`, shared with the
tf-keras layer, so both train tables with the same engine on CPU/GPU, drive the same TPU
backends, and write checkpoints with the same keys. This module only adapts Keras 3: keras-rs
configs, `.keras` saving, and the refusal of what Keras 3 cannot train.
"""

from __future__ import annotations

from typing import Any, Optional

import keras
import tensorflow as tf

from tpu_embedding import hardware, tf_internals
from tpu_embedding.keras import config_conversion, saving, shapes
from tpu_embedding.layer_core import TPUEmbeddingCore


def feature_config_for_keras3(
  feature_config: Any, placements: tuple[str, ...] = config_conversion.ENGINE_PLACEMENTS
) -> Any:
  """The user's nest as mid-level configs, once the Keras 3 backend is known to be TensorFlow."""
  if keras.backend.backend() != "tensorflow":
    raise RuntimeError(
      f"tpu_embedding.keras needs the TensorFlow backend of Keras 3, but KERAS_BACKEND is "
      f"{keras.backend.backend()!r}. Set KERAS_BACKEND=tensorflow before importing keras."
    )
  num_replicas = tf.distribute.get_strategy().num_replicas_in_sync
  return config_conversion.to_mid_level(feature_config, num_replicas, placements)


@keras.saving.register_keras_serializable(package="tpu_embedding")
class TPUEmbedding(saving.KerasFileMixin, TPUEmbeddingCore, keras.layers.Layer):
  """Embedding lookups for large tables, trained as the TPU embedding engine trains them.

  The same layer as `tpu_embedding.TPUEmbedding`, for Keras 3 models (`tf.keras` on TF 2.16+,
  keras-rs users).

  Args:
    feature_config: any nest of `tf.tpu.experimental.embedding.FeatureConfig` or of
      `keras_rs.layers.FeatureConfig` (converted by `tpu_embedding.keras.config_conversion`).
    optimizer: for every table without its own optimizer: a string, a Keras optimizer or a
      `tf.tpu.experimental.embedding` optimizer. None is for serving-only layers.
    pipeline_execution_with_tensor_core: overlap embedding and dense work on TPU; emulated on CPU.
    batch_size: per-replica batch size for building the TPU V1 engine (deprecated by TF).
    embedding_feature: force a TPU embedding feature (`UNSUPPORTED` is always allowed).
    sparse_core_embedding_config: passed to `TPUEmbeddingV2` on SparseCore.
    check_finite: off TPU, raise an error naming the feature or table at the first NaN/Inf
      gradient, weight or learning rate on its way to a table, before anything is written.
    **kwargs: Keras layer arguments (`name`, ...).

  Tables are always trained by each table's own optimizer through the gradient trap, never by
  the model's optimizer (whose zero update of the trap weight is harmless).
  """

  def __init__(
    self,
    feature_config: Any,
    optimizer: Any = None,
    pipeline_execution_with_tensor_core: bool = False,
    batch_size: Optional[int] = None,
    embedding_feature: Optional[hardware.EmbeddingFeature] = None,
    sparse_core_embedding_config: Any = None,
    check_finite: bool = False,
    **kwargs,
  ):
    super().__init__(
      feature_config_for_keras3(feature_config),
      optimizer,
      pipeline_execution_with_tensor_core=pipeline_execution_with_tensor_core,
      batch_size=batch_size,
      embedding_feature=embedding_feature,
      sparse_core_embedding_config=sparse_core_embedding_config,
      check_finite=check_finite,
      **kwargs,
    )
    self._arguments = dict(
      pipeline_execution_with_tensor_core=pipeline_execution_with_tensor_core,
      batch_size=batch_size,
      check_finite=check_finite,
    )
    if self._backend.table_updates == "keras":
      raise ValueError(
        f"TPUEmbedding for Keras 3 on {self.execution_path.name}: these tables would be trained "
        "by the model's optimizer (table_updates='keras', or a TPU without an embedding "
        "engine), which in Keras 3 only updates Keras variables. Leave table_updates at "
        "'engine', or use the tf-keras layer tpu_embedding.TPUEmbedding."
      )

  def build(self, input_shape: Any) -> None:
    # Keras 3 gives shapes as tuples, which tf.nest would take for more structure: hand the
    # backend one TensorShape per feature, as tf-keras does (TPU V1 builds from them).
    try:
      input_shape = tf_internals.map_structure_up_to(
        self._config.feature_config, tf.TensorShape, input_shape
      )
    except (TypeError, ValueError):
      pass  # not the features' structure (e.g. None): the backend detects shapes on its own
    super().build(input_shape)

  # `training` is in the signature: Keras 3 passes it only to a `call` that names it, and
  # without it an inference call (predict, evaluate) would admit keys. `remapped` and the rest
  # go through to TPUEmbeddingCore.call.
  def call(
    self, features: Any, weights: Any = None, serving_config: Any = None, training: Any = None, **kw
  ) -> Any:
    features = shapes.cast_placeholders(features)
    return super().call(features, weights, serving_config, training=training, **kw)

  def compute_output_spec(
    self, features: Any, weights: Any = None, serving_config: Any = None, **unused: Any
  ):
    """The outputs' specs; `training` and `remapped` do not change them."""
    if serving_config is not None:  # another nest of features: trace it
      return super().compute_output_spec(features, weights, serving_config)
    return shapes.output_spec(self._config, features, shapes.mid_level_shape)

  def compute_output_shape(self, input_shape: Any) -> Any:
    return shapes.output_shape(self._config, input_shape, shapes.mid_level_shape)
