"""`TPUEmbedding` for tf-keras: the Keras layer users put in their models, a thin shell.

The execution path is decided once, at construction, from the strategy in scope
(`tpu_embedding.hardware`); everything path-specific lives in `tpu_embedding.backends`, and
everything the layer does in `tpu_embedding.layer_core`, shared with the Keras 3 layer
(`tpu_embedding.keras`).
"""

from __future__ import annotations

import tf_keras

from tpu_embedding import hardware
from tpu_embedding.layer_core import TPUEmbeddingCore


class TPUEmbedding(TPUEmbeddingCore, tf_keras.layers.Layer):
  """Embedding lookups for large tables, trained as the TPU embedding engine trains them.

  A drop-in replacement for `tfrs.layers.embedding.TPUEmbedding` (same arguments, same call).

  Args:
    feature_config: any nest of `tf.tpu.experimental.embedding.FeatureConfig`.
    optimizer: for every table without its own `TableConfig.optimizer`: a string, a Keras
      optimizer of any family, or a `tf.tpu.experimental.embedding` optimizer. None is for
      serving-only layers (no slot variables).
    pipeline_execution_with_tensor_core: overlap embedding and dense work on TPU; on CPU the
      same one-step-stale lookups are emulated so its effect can be measured before paying.
    batch_size: per-replica batch size for building the TPU V1 engine (deprecated by TF).
    embedding_feature: force a TPU embedding feature (`UNSUPPORTED` is always allowed).
    sparse_core_embedding_config: passed to `TPUEmbeddingV2` on SparseCore.
    table_updates: off TPU, "engine" (default) trains tables with each table's mid-level
      optimizer exactly as the TPU does; "keras" makes the tables trainable variables updated by
      the Keras optimizer the user applies (the tf-recommenders behaviour).
  """

  @property
  def path(self) -> hardware.Path:
    """The execution path chosen at construction (`execution_path`, the name both flavours share)."""
    return self.execution_path
