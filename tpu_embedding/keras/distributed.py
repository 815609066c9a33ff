"""`DistributedEmbedding`: keras-rs 0.4's layer, over this package's engine.

keras-rs users switch by importing `tpu_embedding.keras.DistributedEmbedding` instead of
`keras_rs.layers.DistributedEmbedding`: the constructor, `call`, `preprocess` and
`get_embedding_tables` are keras-rs's. What changes is how tables train: each table is always
trained by its own `TableConfig.optimizer`, the way the TPU embedding engine trains it, on every
hardware (keras-rs off TPU hands its tables to the model's optimizer instead).

The layer is `PartialTPUEmbedding`'s core with the side of each table chosen by its keras-rs
`placement` rather than by its size:

* `"default_device"`: replicated on every device and trained by the engine with the table's own
  optimizer (on TPU, in TensorCore memory);
* `"auto"`: the TPU's embedding engine where there is one (TPU V1 or SparseCore), replicated as
  `"default_device"` elsewhere;
* `"sparsecore"`: the TPU's embedding engine; refused where there is none.

Inputs follow keras-rs: a dense `[B, L]` id tensor is one bag of `L` ids per row (a dense `[B]`
one id per row), weighted by a dense weight tensor of the same shape and reduced by the table's
combiner, like a ragged or sparse input. Dense bags are handed on as ragged tensors of uniform
row length, which every path takes (TPU V1 included) and XLA compiles.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import keras
import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding import hardware
from tpu_embedding.keras import config_conversion, saving, shapes
from tpu_embedding.keras.layer import TPUEmbedding, feature_config_for_keras3
from tpu_embedding.partial_core import PartialTPUEmbeddingCore
from tpu_embedding.placement import REPLICATED, SHARDED

PLACEMENTS = ("auto", "default_device", "sparsecore")
# The key of what `preprocess` returns, which `call` recognises.
PREPROCESSED_KEY = "tpu_embedding_preprocessed"
_ENGINE_PATHS = (hardware.ExecutionPath.TPU_V1, hardware.ExecutionPath.TPU_V2)


class TableView(keras.layers.Layer):
  """One replicated table, as keras-rs's per-table sublayer shows it (not trained through it).

  Attributes `table` (the keras-rs or mid-level config), `input_dim`, `output_dim` and
  `embeddings` (the variable the engine trains). Lookups go through `DistributedEmbedding`.
  """

  def __init__(self, table: Any, variables: Mapping[str, tf.Variable], **kwargs):
    super().__init__(**kwargs)
    self._table = self._no_dependency(table)
    # The engine's dict, read when asked: `update_embedding_table` may replace the variable.
    self._variables = self._no_dependency(variables)
    self.built = True  # nothing to build: it is never called

  def get_config(self) -> dict:
    # Described, never rebuilt from it: `DistributedEmbedding` creates its views.
    return {"name": self.name, "input_dim": self.input_dim, "output_dim": self.output_dim}

  @property
  def table(self) -> Any:
    return self._table

  @property
  def embeddings(self) -> tf.Variable:
    return self._variables["parameters"]

  @property
  def input_dim(self) -> int:
    return self.embeddings.shape[0]

  @property
  def output_dim(self) -> int:
    return self.embeddings.shape[1]


@keras.saving.register_keras_serializable(package="tpu_embedding")
class DistributedEmbedding(saving.KerasFileMixin, PartialTPUEmbeddingCore, keras.layers.Layer):
  """keras-rs's `DistributedEmbedding`, with every table trained by its own optimizer.

  Args:
    feature_configs: a nest of `keras_rs.layers.FeatureConfig` (or of
      `tf.tpu.experimental.embedding.FeatureConfig`, placed by `placements`); the output has
      the same structure.
    table_stacking: keras-rs's SparseCore table stacking: `"auto"` (TF stacks tables) or None
      (no stacking). Only read for tables on SparseCore.
    update_stats: keras-rs's JAX-only statistics; True is refused, as keras-rs refuses it on
      TensorFlow.
    optimizer: for tables without their own optimizer (mid-level configs).
    pipeline_execution_with_tensor_core: passed to the embedding engine's side.
    sparse_core_embedding_config: passed to `TPUEmbeddingV2` when the configs are mid-level
      ones (keras-rs configs take `table_stacking` instead).
    placements: {table name: placement} for mid-level configs (default `"auto"`); keras-rs
      configs carry their own.
    **kwargs: Keras layer arguments (`name`, ...).
  """

  sharded_layer_class = TPUEmbedding

  def __init__(
    self,
    feature_configs: Any,
    *,
    table_stacking: Any = "auto",
    update_stats: bool = False,
    optimizer: Any = None,
    pipeline_execution_with_tensor_core: bool = False,
    sparse_core_embedding_config: Any = None,
    placements: Optional[Mapping[str, str]] = None,
    **kwargs,
  ):
    if update_stats:
      raise ValueError(
        "DistributedEmbedding: update_stats=True is only supported by keras-rs on JAX; on "
        "TensorFlow leave it False."
      )
    converted = feature_config_for_keras3(feature_configs, config_conversion.ALL_PLACEMENTS)
    by_table = _placements(feature_configs, converted, placements or {})
    path = hardware.choose_path(tf.distribute.get_strategy())
    self._sides_by_table = {
      table: _side(table.name, placement, path) for table, placement in by_table.items()
    }
    stacking = config_conversion.sparse_core_config(table_stacking)  # refused on every path
    if sparse_core_embedding_config is None and path is hardware.ExecutionPath.TPU_V2:
      sparse_core_embedding_config = stacking
    super().__init__(
      converted,
      optimizer,
      pipeline_execution_with_tensor_core=pipeline_execution_with_tensor_core,
      size_threshold=None,
      sparse_core_embedding_config=sparse_core_embedding_config,
      **kwargs,
    )
    self._arguments = dict(
      table_stacking=table_stacking,
      pipeline_execution_with_tensor_core=pipeline_execution_with_tensor_core,
      placements={
        self._config.find_table(table).name: placement for table, placement in by_table.items()
      },
    )
    replicated = {} if self._replicated is None else self._replicated.variables_by_table
    self._table_views = [
      TableView(self._config.user_tables[table], replicated[table.name], name=table.name)
      for table in self._config.tables
      if table.name in replicated
    ]

  def get_config(self) -> dict:
    config = super().get_config()
    # Plain values: the tracked copies Keras keeps of attributes drag their owner along.
    config["placements"] = dict(config["placements"])
    return config

  def _choose_sides(self, size_threshold: Optional[int]) -> dict[str, str]:
    del size_threshold  # placements decide
    return {t.name: self._sides_by_table[self._config.user_tables[t]] for t in self._config.tables}

  # -------------------------------------------------------------------------------------------
  # keras-rs's surface

  # `training` reaches managed ids (inference calls admit no keys), as in the other layers;
  # tables are trained through the gradient whatever it says. `remapped`: rows from `remap`.
  def call(
    self, inputs: Any, weights: Any = None, training: Any = None, remapped: bool = False
  ) -> Any:
    if _is_preprocessed(inputs):
      inputs, packed = inputs[PREPROCESSED_KEY]
      weights = _preprocessed_weights(packed, weights)
    else:
      inputs, weights = self._as_bags(shapes.cast_placeholders(inputs), weights)
    return super().call(inputs, weights, training=training, remapped=remapped)

  def preprocess(self, inputs: Any, weights: Any = None, training: bool = False) -> Any:
    """The inputs (and weights) as the bags `call` looks up, packed for `call(preprocessed)`.

    Optional on TensorFlow (keras-rs needs it on JAX only): it lets a `tf.data` pipeline do
    the conversion of dense bags.
    """
    del training
    return {PREPROCESSED_KEY: self._as_bags(inputs, weights)}

  def get_embedding_tables(self) -> dict[str, tf.Tensor]:
    """Every table's current value by table name (copies: assigning to them changes nothing)."""
    return {
      table.name: tf.convert_to_tensor(value) for table, value in self.embedding_tables.items()
    }

  @property
  def trainable_variables(self) -> list[tf.Variable]:
    """What keras-rs lists: the replicated tables, and the embedding engine's gradient trap
    when some tables are there (keras-rs on TPU lists its trap too).

    A gradient taken with respect to these trains every table, each by its own optimizer
    (the tables' own gradients come back None: no other optimizer may touch them). Keras's
    own lists (`model.trainable_variables`) hold this layer's gradient trap instead.
    """
    tables = [view.embeddings for view in self._table_views]
    return tables + ([] if self._sharded is None else list(self._sharded.trainable_variables))

  def compute_output_spec(self, inputs: Any, weights: Any = None, training: bool = False) -> Any:
    return shapes.output_spec(self._config, inputs, shapes.bag_shape)

  def compute_output_shape(self, input_shape: Any) -> Any:
    return shapes.output_shape(self._config, input_shape, shapes.bag_shape)

  # -------------------------------------------------------------------------------------------
  # Helpers

  def _as_bags(self, inputs: Any, weights: Any) -> tuple[Any, Any]:
    """Dense ids (and their dense weights) as ragged bags of uniform length."""
    pairs = config_lib.match_structure(self._config, inputs)
    weight_leaves = config_lib.weight_leaves(inputs, weights, len(pairs))
    bags = [_dense_as_bag(f.name, ids, w) for (f, ids), w in zip(pairs, weight_leaves)]
    ids = tf.nest.pack_sequence_as(inputs, [i for i, _ in bags])
    if weights is not None:
      weights = tf.nest.pack_sequence_as(inputs, [w for _, w in bags])
    return ids, weights

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    children = super()._trackable_children(save_type, **kwargs)
    if save_type == "checkpoint":
      children.pop("_table_views", None)  # views of variables the checkpoint already holds
    return children


def _is_preprocessed(inputs: Any) -> bool:
  return isinstance(inputs, Mapping) and set(inputs) == {PREPROCESSED_KEY}


def _preprocessed_weights(packed: Any, given: Any) -> Any:
  """The weights `preprocess` packed; weights given to `call` beside preprocessed inputs are
  refused (keras-rs drops them silently): they belong in `preprocess`, which converts both."""
  if given is not None:
    raise ValueError(
      "DistributedEmbedding.call was given `weights` with preprocessed inputs, which already "
      "hold theirs: pass the weights to preprocess(inputs, weights) instead. Nothing was "
      "looked up."
    )
  return packed


def _dense_as_bag(name: str, ids: Any, weights: Any) -> tuple[Any, Any]:
  """One feature's dense `[B]` / `[B, L]` ids and weights as `[B, (L)]` ragged bags."""
  if isinstance(ids, (tf.RaggedTensor, tf.SparseTensor)):
    return ids, weights
  ids = tf.convert_to_tensor(ids)
  if ids.shape.rank not in (1, 2):
    raise ValueError(
      f"Feature {name!r}: dense ids must be [batch] or [batch, bag size], got shape "
      f"{ids.shape}. Pass longer bags as a RaggedTensor or SparseTensor."
    )
  bag = lambda t: tf.RaggedTensor.from_uniform_row_length(
    tf.reshape(t, [-1]),
    tf.shape(t, out_type=tf.int64)[1] if t.shape.rank == 2 else 1,
    validate=False,
  )
  if weights is None:
    return bag(ids), None
  if isinstance(weights, (tf.RaggedTensor, tf.SparseTensor)):
    raise ValueError(
      f"Feature {name!r}: its ids are a dense Tensor but its weights a "
      f"{type(weights).__name__}; give dense weights of the ids' shape {ids.shape}."
    )
  weights = tf.convert_to_tensor(weights)
  if not weights.shape.is_compatible_with(ids.shape):
    raise ValueError(
      f"Feature {name!r}: dense weights of shape {weights.shape} for dense ids of shape "
      f"{ids.shape}; give one weight per id."
    )
  return bag(ids), bag(weights)


def _placements(user_configs: Any, converted: Any, given: Mapping[str, str]) -> dict[Any, str]:
  """{converted mid-level TableConfig: placement}: keras-rs's own, else `given` by name."""
  names = {feature.table.name for feature in tf.nest.flatten(converted)}
  unknown = sorted(set(given) - names, key=str)
  if unknown:
    raise ValueError(
      f"DistributedEmbedding(placements=...) names tables {unknown} that no feature uses; its "
      f"tables are {sorted(names)}."
    )
  result = {}
  for user, mid_level in zip(tf.nest.flatten(user_configs), tf.nest.flatten(converted)):
    if config_conversion.is_keras_rs_feature(user):
      placement = user.table.placement
    else:
      placement = given.get(mid_level.table.name, "auto")
    if placement not in PLACEMENTS:
      raise ValueError(
        f"Table {mid_level.table.name!r}: placement={placement!r}; expected one of "
        f"{', '.join(map(repr, PLACEMENTS))}."
      )
    result.setdefault(mid_level.table, placement)
  return result


def _side(table: str, placement: str, path: hardware.ExecutionPath) -> str:
  """The core's side for one table's keras-rs placement on this hardware."""
  if placement == "default_device":
    return REPLICATED
  if path in _ENGINE_PATHS:
    return SHARDED
  if placement == "sparsecore":
    raise ValueError(
      f"Table {table!r} has placement='sparsecore', but this {path.name} path has no TPU "
      "embedding engine (SparseCore or TPU V1) to place it on. Use placement='auto' (the "
      "engine where there is one, replicated elsewhere) or 'default_device'."
    )
  return REPLICATED
