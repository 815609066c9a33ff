"""The per-path refusals and conversions of the prepared configuration, apart from execution.

Each TPU path takes the user's configuration in its own form: V0 trains its replicated tables
with the Keras optimizer (no mid-level optimizer may reach TF's class), V1 needs each
optimizer's packing status as the proto's enum, V2 needs output shapes and applies no clipping.
What a path cannot honour is refused here by table, feature or argument; what it needs in
another form is returned as a new `EmbeddingConfig` (`EmbeddingConfig.with_optimizers`), so the
layer's own prepared configuration, which it exposes as `embedding_config`, never changes.
"""

from __future__ import annotations

import copy
import numbers
import typing
from typing import Any

import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding import hardware, optimizers, tf_internals

_PACKING = tf_internals.PackingStatus

# Who updates the tables (the layers' `table_updates`): "engine", each table's own mid-level
# optimizer, reached through the gradient trap; "keras", the Keras optimizer the model applies
# to the tables as trainable variables.
TABLE_UPDATES = ("engine", "keras")


def check_layer_options(
  path: hardware.ExecutionPath, table_updates: Any, check_finite: Any, batch_size: Any = None
):
  """Refuses a layer option that is misspelt, or that the path cannot honour (`batch_size` on
  every path: only TPU V1 reads it, so elsewhere a bad one would pass unnoticed until then)."""
  if batch_size is not None and (
    isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size <= 0
  ):
    raise ValueError(
      f"batch_size={batch_size!r}; expected a positive int (the per-replica batch size) or None."
    )
  if table_updates not in TABLE_UPDATES:
    raise ValueError(f"table_updates={table_updates!r}; expected one of {TABLE_UPDATES}.")
  if not isinstance(check_finite, bool):  # a truthy string would silently enable it
    raise TypeError(f"check_finite={check_finite!r}; expected True or False.")
  if check_finite and path is not hardware.ExecutionPath.CPU:
    raise ValueError(
      f"check_finite=True is an option of the CPU/GPU engine; on {path.name} the TPU updates "
      "the tables itself and cannot stop at a non-finite value. Leave it off under a "
      "TPUStrategy (e.g. TPUEmbedding(..., check_finite=not on_tpu))."
    )


# ---------------------------------------------------------------------------------------------
# V0: replicated tables trained by the Keras optimizer


def for_tpu_v0(
  config: config_lib.EmbeddingConfig, user_optimizer: Any
) -> config_lib.EmbeddingConfig:
  """The configuration TF's V0 class receives: no optimizer on any table (its slots would live
  in the Keras optimizer, and TF would create slots here that nothing updates)."""
  _refuse_mid_level_optimizers(config, user_optimizer)
  return config.with_optimizers(lambda table: None, None)


def _refuse_mid_level_optimizers(config: config_lib.EmbeddingConfig, user_optimizer: Any) -> None:
  given = [("optimizer", user_optimizer)] + [
    (f"TableConfig {clone.name!r}.optimizer", config.user_tables[clone].optimizer)
    for clone in config.tables
  ]
  for where, optimizer in given:
    if isinstance(optimizer, typing.get_args(optimizers.MidLevelOptimizer)):
      raise ValueError(
        f"{where} is a tf.tpu.experimental.embedding.{type(optimizer).__name__}, but this TPU "
        f"has no embedding engine (path {hardware.ExecutionPath.TPU_V0.name}, embedding feature "
        "UNSUPPORTED): its replicated tables are trained by the Keras optimizer your train "
        "step applies, which cannot follow a mid-level optimizer's TPU semantics. Pass a "
        "Keras optimizer (or its name) and apply that same optimizer to the model."
      )


# ---------------------------------------------------------------------------------------------
# V1: the TPU embedding engine


def for_tpu_v1(config: config_lib.EmbeddingConfig) -> config_lib.EmbeddingConfig:
  """The configuration TF's V1 class receives: every table trained by a mid-level optimizer
  whose packing status is the proto's enum.

  TF's V1 class writes `optimizer.low_dimensional_packing_status` verbatim into an enum field of
  `OptimizationParameters`; its default (the bool False) is refused by protobuf >= 5, so every
  V1 `build()` would fail. The enum value with the same meaning (False -> UNSPECIFIED, the
  field's default; True -> ENABLED) builds the same proto. Copies keep the user's and the
  layer's optimizers untouched; tables that shared one optimizer still share one copy.
  """
  require_optimizers(config, hardware.ExecutionPath.TPU_V1)
  copies: dict[int, Any] = {}

  def with_enum(optimizer: Any) -> Any:
    if optimizer is None or not isinstance(optimizer.low_dimensional_packing_status, bool):
      return optimizer
    if id(optimizer) not in copies:
      fixed = copy.copy(optimizer)
      fixed.low_dimensional_packing_status = (
        _PACKING.ENABLED if optimizer.low_dimensional_packing_status else _PACKING.UNSPECIFIED
      )
      copies[id(optimizer)] = fixed
    return copies[id(optimizer)]

  return config.with_optimizers(
    lambda table: with_enum(table.optimizer), with_enum(config.optimizer)
  )


def refuse_wide_dense_ids(config: config_lib.EmbeddingConfig, features: Any) -> None:
  """Dense [B, L > 1] ids of a non-sequence feature: the CPU reads L samples per row, V1's
  enqueue refuses them deep inside TF; refused here by feature name."""
  for feature, ids in config_lib.match_structure(config, features):
    shape = getattr(ids, "shape", None)
    if (
      isinstance(ids, tf.Tensor)
      and shape.rank is not None
      and shape.rank >= 2
      and shape[-1] not in (None, 1)
      and not feature.config.max_sequence_length
    ):
      raise ValueError(
        f"Feature {feature.name!r}: dense ids of shape {shape.as_list()}, but on path "
        f"{hardware.ExecutionPath.TPU_V1.name} a dense Tensor must hold one id per sample ([B] or "
        "[B, 1]). Pass bags of ids as a RaggedTensor or SparseTensor, or set "
        "FeatureConfig.max_sequence_length for a sequence feature."
      )


# ---------------------------------------------------------------------------------------------
# V2: SparseCore


def for_tpu_v2(config: config_lib.EmbeddingConfig) -> config_lib.EmbeddingConfig:
  """The configuration TF's SparseCore class receives (the prepared one: nothing to convert),
  after refusing what SparseCore would silently get wrong."""
  require_optimizers(config, hardware.ExecutionPath.TPU_V2)
  _require_output_shapes(config)
  _refuse_what_sparse_core_ignores(config)
  return config


def require_optimizers(config: config_lib.EmbeddingConfig, path: hardware.ExecutionPath) -> None:
  missing = [table.name for table in config.tables if table.optimizer is None]
  if missing:
    raise ValueError(
      f"Tables {missing} have no optimizer, but on path {path.name} the TPU trains every "
      "table with its own mid-level optimizer. optimizer=None is only for serving-only layers "
      "off TPU: pass optimizer= (or TableConfig.optimizer)."
    )


def _require_output_shapes(config: config_lib.EmbeddingConfig) -> None:
  missing = [f.name for f in config.features if not f.config.output_shape.is_fully_defined()]
  if missing:
    raise ValueError(
      f"Features {missing} have no fully defined FeatureConfig.output_shape, but on path "
      f"{hardware.ExecutionPath.TPU_V2.name} (SparseCore) TensorFlow cannot derive output shapes "
      "from the inputs: set output_shape=[per-replica batch size] (or [batch, sequence length])."
    )


def _refuse_what_sparse_core_ignores(config: config_lib.EmbeddingConfig) -> None:
  """TF's SparseCore update never applies gradient or weight clipping (it passes neither to its
  ops) and has no weight decay: refused by table and setting, rather than trained without."""
  for table in config.tables:
    optimizer = table.optimizer
    settings = {
      "clipvalue": (optimizer.clip_gradient_min, optimizer.clip_gradient_max),
      "clip_weight_min": (optimizer.clip_weight_min,),
      "clip_weight_max": (optimizer.clip_weight_max,),
      "weight_decay_factor": (optimizer.weight_decay_factor,),
      "multiply_weight_decay_factor_by_learning_rate": (
        optimizer.multiply_weight_decay_factor_by_learning_rate,
      ),
    }
    for setting, values in settings.items():
      if any(value is not None for value in values):
        raise ValueError(
          f"Table {table.name!r}: its optimizer sets {setting}, which SparseCore (path "
          f"{hardware.ExecutionPath.TPU_V2.name}) does not apply: TensorFlow's SparseCore update "
          "has no gradient clipping, weight clipping or weight decay. Remove the setting for this "
          "path (the CPU, V1 and Keras paths apply it)."
        )
