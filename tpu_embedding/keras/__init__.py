"""The Keras 3 surface: the `TPUEmbedding` layers for Keras 3 with the TensorFlow backend
(`tf.keras` on TF 2.16+), and the package's other public names.

The same layers as `tpu_embedding.TPUEmbedding` / `PartialTPUEmbedding` (tf-keras), sharing
their configuration, hardware dispatch, TPU backends and CPU engine; importing this package
never imports tf-keras. Refused (`tf_versions.UnsupportedKeras`) under a Keras older than
`tf_versions.KERAS_MINIMUM`, e.g. the Keras 2 of TF 2.15.
"""

import keras

from tpu_embedding import tf_versions

tf_versions.require_keras(keras.__version__)  # before any module that reads Keras 3 internals

from tpu_embedding.hardware import EmbeddingFeature, ExecutionPath
from tpu_embedding.keras import config_conversion  # keras-rs's conversion functions, by their names
from tpu_embedding.keras.distributed import DistributedEmbedding
from tpu_embedding.keras.layer import TPUEmbedding
from tpu_embedding.keras.partial import PartialTPUEmbedding
from tpu_embedding.optimizers import NotAnOptimizerError, translate_keras_optimizer
from tpu_embedding.partial_core import ReplicatedTable
from tpu_embedding.placement import Placement, TablePlacement
from tpu_embedding.serving import export_for_serving
from tpu_embedding.sparse_core import restore_from_checkpoint as restore_sparse_core_checkpoint

__all__ = [
  "DistributedEmbedding",
  "config_conversion",
  "EmbeddingFeature",
  "ExecutionPath",
  "NotAnOptimizerError",
  "PartialTPUEmbedding",
  "Placement",
  "ReplicatedTable",
  "TPUEmbedding",
  "TablePlacement",
  "export_for_serving",
  "restore_sparse_core_checkpoint",
  "translate_keras_optimizer",
]
