"""What both Keras flavours of `PartialTPUEmbedding` share: everything but the Keras base class.

Small tables are replicated on every device, large ones sharded. Each table goes to one side,
decided once at construction from its size. All features of a table go to the same side:

* **sharded** (`vocabulary_size > size_threshold`): served by this package's `TPUEmbedding`
  layer, so on TPU they live in the embedding engine's memory, split by rows over the devices;
* **replicated** (everything else): whole on every device (on TPU, in TensorCore memory as
  ordinary replicated variables), looked up and trained by the CPU engine (`EmbeddingEngine`)
  with the table's own mid-level optimizer, exactly as the sharded side trains its tables.

Both sides therefore give the same activations and the same updates for the same configs; the
threshold only moves memory. With `table_updates="keras"` the replicated tables are instead
trainable variables trained by the user's Keras optimizer on every hardware, as tf-recommenders
trains them (and so are the sharded ones off TPU). Where each table goes, and what it costs per
device, is reported by `PartialTPUEmbedding.placement()`.

Checkpoints do not depend on the side: every table and slot is saved under the same dependency
names as a `TPUEmbedding` layer's (`_tpu_embedding/<table>` and `_tpu_embedding/<table>/<slot>`),
so a checkpoint restores under any other threshold, and into or from a plain `TPUEmbedding`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import tensorflow as tf
from tensorflow.python.trackable import autotrackable
from tensorflow.python.util import nest as tf_nest  # path-aware flattening, same order as tf.nest

from tpu_embedding import backends
from tpu_embedding import checkpoints
from tpu_embedding import config as config_lib
from tpu_embedding import hardware
from tpu_embedding import optimizers
from tpu_embedding import sparse_core
from tpu_embedding.engine import inputs as engine_inputs
from tpu_embedding.engine.engine import EmbeddingEngine
from tpu_embedding.layer_core import TPUEmbeddingCore

TableConfig = tf.tpu.experimental.embedding.TableConfig

REPLICATED = "replicated"
SHARDED = "sharded"

_FLOAT32_BYTES = 4
_TRAP_NAME = "partial_embedding_helper_dummy"
# On TPU paths the sharded layer stays in the checkpoint too, under this name, so TensorFlow's
# save/restore callbacks move the tables between TPU memory and their host variables.
_SHARDED_LAYER_KEY = "_sharded_embedding"


# ---------------------------------------------------------------------------------------------
# Placement report


@dataclasses.dataclass(frozen=True)
class TablePlacement:
  """Where one table lives and what it costs.

  Attributes:
    table: the table's name.
    side: `"replicated"` or `"sharded"`.
    vocabulary_size, dim: the table's shape.
    slots: the optimizer's slot variable names (none for SGD or no optimizer).
    features: the feature paths served by the table.
    bytes: float32 bytes of the whole table plus its slots.
    bytes_per_device: the most bytes any one device holds: replicated, the whole `bytes`;
      sharded over n devices, `ceil(vocabulary_size / n)` rows of table and slots.
  """

  table: str
  side: str
  vocabulary_size: int
  dim: int
  slots: tuple[str, ...]
  features: tuple[str, ...]
  bytes: int
  bytes_per_device: int


@dataclasses.dataclass(frozen=True)
class Placement:
  """`PartialTPUEmbedding.placement()`: every table's side and memory; `str()` prints a table."""

  size_threshold: Optional[int]
  num_replicas: int
  tables: tuple[TablePlacement, ...]

  def __getitem__(self, table_name: str) -> TablePlacement:
    for entry in self.tables:
      if entry.table == table_name:
        return entry
    raise KeyError(f"No table named {table_name!r}; tables: {[t.table for t in self.tables]}.")

  def bytes_per_device(self, side: Optional[str] = None) -> int:
    """Bytes each device holds for one side, or for both when `side` is None."""
    return sum(t.bytes_per_device for t in self.tables if side in (None, t.side))

  def __str__(self) -> str:
    header = ("table", "side", "rows", "dim", "slots", "bytes", "bytes/device")
    rows = [
      (
        t.table,
        t.side,
        f"{t.vocabulary_size:,}",
        str(t.dim),
        ",".join(t.slots) or "-",
        f"{t.bytes:,}",
        f"{t.bytes_per_device:,}",
      )
      for t in self.tables
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    numeric = {2, 3, 5, 6}

    def line(cells):
      return "  ".join(
        c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
      ).rstrip()

    title = (
      f"PartialTPUEmbedding placement: size_threshold={self.size_threshold}, "
      f"{self.num_replicas} replica(s), float32 table + optimizer slots"
    )
    footer = (
      f"per device: replicated {self.bytes_per_device(REPLICATED):,} B + sharded "
      f"{self.bytes_per_device(SHARDED):,} B = {self.bytes_per_device():,} B"
    )
    return "\n".join([title, line(header), *map(line, rows), footer])


# ---------------------------------------------------------------------------------------------
# What serves a replicated feature


@dataclasses.dataclass(frozen=True, eq=False)
class ReplicatedTable:
  """A replicated table, as `keras_embedding_layers` reports it (not a Keras layer).

  It carries the attributes tf-recommenders users read from `tf.keras.layers.Embedding`
  (`input_dim`, `output_dim`, `embeddings`) plus the user's `table` config. Lookups and training
  go through the layer, never through this object.
  """

  table: TableConfig
  embeddings: tf.Variable

  @property
  def name(self) -> str:
    return self.embeddings.name.split(":")[0]

  @property
  def input_dim(self) -> int:
    return self.table.vocabulary_size

  @property
  def output_dim(self) -> int:
    return self.table.dim


class CheckpointNode(autotrackable.AutoTrackable):
  """A node of the checkpoint's object graph whose children are named freely: table names,
  `<table>/<slot>` and feature paths, which need not be Python identifiers."""

  def add(self, name: str, child: Any) -> None:
    self._track_trackable(child, name=name, overwrite=True)


# ---------------------------------------------------------------------------------------------
# The layer


class PartialTPUEmbeddingCore:
  """The layer behaviour, mixed in before a Keras `Layer` class (see the two flavours).

  `sharded_layer_class` is the flavour's `TPUEmbedding`, which serves the sharded tables.
  """

  sharded_layer_class: type

  def __init__(
    self,
    feature_config: Any,
    optimizer: Any = None,
    pipeline_execution_with_tensor_core: bool = False,
    batch_size: Optional[int] = None,
    size_threshold: Optional[int] = 10_000,
    table_updates: str = "engine",
    **kwargs,
  ):
    super().__init__(**kwargs)
    if table_updates not in backends.TABLE_UPDATES:
      raise ValueError(
        f"table_updates={table_updates!r}; expected one of {backends.TABLE_UPDATES}."
      )
    self._table_updates = table_updates
    if size_threshold is not None and (
      isinstance(size_threshold, bool) or not isinstance(size_threshold, int) or size_threshold < 0
    ):
      raise ValueError(
        f"size_threshold={size_threshold!r}; expected an int >= 0 (0 shards "
        "every table) or None (replicates every table)."
      )
    self._size_threshold = size_threshold
    self._config = config_lib.prepare(feature_config, optimizer)  # names every table once
    self._sides = tuple(
      (
        table.name,
        SHARDED
        if size_threshold is not None and table.vocabulary_size > size_threshold
        else REPLICATED,
      )
      for table in self._config.tables
    )
    side_of = dict(self._sides)
    # Each side gets a flat {feature path: cloned FeatureConfig}; the clones already carry the
    # names and optimizers resolved over the whole nest, so names never depend on the threshold.
    per_side = {REPLICATED: {}, SHARDED: {}}
    for feature in self._config.features:
      per_side[side_of[feature.table.name]][feature.path] = feature.config
    self._paths = tuple((f.path, side_of[f.table.name]) for f in self._config.features)

    self._sharded = None  # the TPUEmbedding layer serving the sharded tables
    if per_side[SHARDED]:
      _refuse_sharding_without_embedding_hardware(sorted(per_side[SHARDED]))
      self._sharded = self.sharded_layer_class(
        per_side[SHARDED],
        self._config.optimizer,
        pipeline_execution_with_tensor_core=pipeline_execution_with_tensor_core,
        batch_size=batch_size,
        table_updates=table_updates,
        name="sharded_embedding",
      )
      if self._sharded.execution_path is hardware.ExecutionPath.CPU:
        self._sharded.build(None)  # needs no shapes off TPU: tables exist from the start

    # The replicated engine needs no shapes: build it now, under the strategy in scope, so its
    # variables are that strategy's replicated variables (TensorCore memory on TPU).
    self._replicated = None
    if per_side[REPLICATED]:
      self._replicated = EmbeddingEngine(
        config_lib.prepare(per_side[REPLICATED], self._config.optimizer),
        pipelining=False,
        table_updates=table_updates,
      )
      self._replicated.build()
      if table_updates == "engine":
        optimizers.warn_if_bias_correction_dropped(
          [table for table in self._config.tables if side_of[table.name] == REPLICATED]
        )

    self._tables_view = self._no_dependency(CheckpointNode())
    # tf-recommenders' names for the same variables (see `_track_tables`).
    self._tfrs_sharded_view = self._no_dependency(CheckpointNode())
    self._tfrs_keras_layers_view = self._no_dependency(CheckpointNode())
    self._track_tables()

  # -------------------------------------------------------------------------------------------
  # Public surface

  @property
  def tpu_embedding(self) -> Optional[TPUEmbeddingCore]:
    """The `TPUEmbedding` layer serving the sharded tables, or None when none is sharded."""
    return self._sharded

  @property
  def keras_embedding_layers(self) -> dict[str, ReplicatedTable]:
    """{feature path: the `ReplicatedTable` serving it}, for replicated features only.

    tf-recommenders returned Keras `Embedding` layers here; replicated tables are now trained by
    the embedding engine, so the values are `ReplicatedTable` views with the same `input_dim`,
    `output_dim` and `embeddings` attributes. Features sharing a table share the object. Feature
    paths are those of `tf.nest` (the dict key for a flat dict, "a/b" for nested ones).
    """
    if self._replicated is None:
      return {}
    variables = self._replicated.variables_by_table
    views = {}
    result = {}
    for feature in self._config.features:
      table = feature.table
      if self.side(table.name) != REPLICATED:
        continue
      if table.name not in views:
        views[table.name] = ReplicatedTable(
          self._config.user_tables[table], variables[table.name]["parameters"]
        )
      result[feature.path] = views[table.name]
    return result

  def side(self, table: Any) -> str:
    """`"replicated"` or `"sharded"` for a table name or one of the user's TableConfigs."""
    name = table if isinstance(table, str) else self._clone_of(table).name
    for table_name, side in self._sides:
      if table_name == name:
        return side
    raise ValueError(f"No table named {name!r}; tables: {[n for n, _ in self._sides]}.")

  def placement(self, num_replicas: int = 1) -> Placement:
    """Each table's side and float32 bytes (table + slots), in total and per device.

    A replicated table is whole on each of the `num_replicas` devices; a sharded one is split by
    rows, so the fullest device holds `ceil(vocabulary_size / num_replicas)` rows of the table
    and of each slot. (SparseCore pads rows and columns further; that is not counted.)
    """
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
      raise ValueError(f"num_replicas={num_replicas!r}; expected an int >= 1.")
    entries = []
    for table in self._config.tables:
      slots = [(name, math.prod(shape[1:])) for name, shape in config_lib.slot_shapes(table)]
      row_bytes = _FLOAT32_BYTES * (table.dim + sum(width for _, width in slots))
      side = self.side(table.name)
      rows_per_device = (
        table.vocabulary_size
        if side == REPLICATED
        else math.ceil(table.vocabulary_size / num_replicas)
      )
      entries.append(
        TablePlacement(
          table=table.name,
          side=side,
          vocabulary_size=table.vocabulary_size,
          dim=table.dim,
          slots=tuple(name for name, _ in slots),
          features=tuple(f.path for f in self._config.features_of(table)),
          bytes=table.vocabulary_size * row_bytes,
          bytes_per_device=rows_per_device * row_bytes,
        )
      )
    return Placement(self._size_threshold, num_replicas, tuple(entries))

  @property
  def embedding_tables(self) -> dict[TableConfig, Any]:
    """Every table, either side, keyed by the user's own TableConfig objects.

    Sharded tables are what the sharded layer's `embedding_tables` gives on its path (on TPU,
    copied back from TPU memory first; on SparseCore, each table's logical value).
    """
    by_name = {}
    if self._replicated is not None:
      by_name.update(
        {
          name: variables["parameters"]
          for name, variables in self._replicated.variables_by_table.items()
        }
      )
    if self._sharded is not None and self._sharded.built:
      by_name.update({table.name: value for table, value in self._sharded.embedding_tables.items()})
    return {
      self._config.user_tables[t]: by_name[t.name] for t in self._config.tables if t.name in by_name
    }

  def flush(self) -> None:
    """Applies sharded-side updates held back by pipelining (replicated ones never are)."""
    if self._sharded is not None:
      self._sharded.flush()

  # -------------------------------------------------------------------------------------------
  # Keras

  def build(self, input_shape: Any) -> None:
    if self._sharded is not None and not self._sharded.built:
      self._sharded.build(self._sharded_shapes(input_shape))
    if self._replicated is not None and self._table_updates == "keras":
      # Keras-trained tables must be trainable variables of the model (one per table).
      self._keras_trained_tables = list(self._replicated.embedding_tables.values())
    elif self._replicated is not None:
      setattr(
        self,
        _TRAP_NAME,
        self.add_weight(
          name=_TRAP_NAME, shape=(1,), initializer="zeros", trainable=True, dtype=tf.float32
        ),
      )
    self._track_tables()
    super().build(input_shape)

  def call(self, features: Any, weights: Any = None) -> Any:
    return self._lookup(features, weights)

  # Plain Python over the features, no tensor-dependent control flow: AutoGraph (which tf-keras
  # and Keras 3 apply to a model's call inside `fit`) would convert every function it reaches,
  # the whole engine included, and that conversion cost most of the first step.
  @tf.autograph.experimental.do_not_convert
  def _lookup(self, features: Any, weights: Any) -> Any:
    pairs = config_lib.match_structure(self._config, features)
    weight_leaves = engine_inputs.weight_leaves(features, weights, len(pairs))
    inputs = {REPLICATED: {}, SHARDED: {}}
    input_weights = {REPLICATED: {}, SHARDED: {}}
    side_of_path = dict(self._paths)
    for (feature, ids), w in zip(pairs, weight_leaves):
      side = side_of_path[feature.path]
      inputs[side][feature.path] = ids
      input_weights[side][feature.path] = w

    def side_weights(side):
      given = input_weights[side]
      return given if any(w is not None for w in given.values()) else None

    outputs = {}
    if inputs[SHARDED]:
      outputs.update(self._sharded(inputs[SHARDED], weights=side_weights(SHARDED)))
    if inputs[REPLICATED]:
      outputs.update(
        self._replicated.lookup(
          inputs[REPLICATED], side_weights(REPLICATED), getattr(self, _TRAP_NAME, None)
        )
      )
    packed = tf.nest.pack_sequence_as(features, [outputs[f.path] for f, _ in pairs])
    return _replicated_first(packed, side_of_path)

  # -------------------------------------------------------------------------------------------
  # Checkpoints: one name per table and slot, whatever its side

  @property
  def variables_by_table(self) -> dict[str, dict[str, tf.Variable]]:
    """{table name: {"parameters": table, slot name: slot}} over both sides, for the built ones
    (as `TPUEmbedding.variables_by_table`)."""
    variables = {}
    if self._replicated is not None:
      variables.update(self._replicated.variables_by_table)
    if self._sharded is not None and self._sharded.built:
      variables.update(_sharded_variables(self._sharded))
    return variables

  def _track_tables(self) -> None:
    """Registers every existing table and slot under `<table>` / `<table>/<slot>`.

    Tracking (rather than only listing them at save time) lets a restore issued before the
    tables exist wait for them: the value is applied when the name is tracked here.

    Each table is also tracked under the names tf-recommenders' `PartialTPUEmbedding` restores,
    whatever its threshold (`_keras_embedding_layers/<feature>/embeddings` and
    `_tpu_embedding/_tpu_embedding/<table>`), so its tables load into that class too. A checkpoint
    stores a variable once, however many names lead to it.
    """
    variables_by_table = self.variables_by_table
    for table_name, variables in variables_by_table.items():
      for key, variable in variables.items():
        self._tables_view.add(
          table_name if key == "parameters" else f"{table_name}/{key}", variable
        )
      self._tfrs_sharded_view.add(table_name, variables["parameters"])
    self._tables_view.add(checkpoints.TABLES_KEY, self._tfrs_sharded_view)
    for feature in self._config.features:
      if feature.table.name not in variables_by_table:
        continue
      keras_layer = CheckpointNode()
      keras_layer.add("embeddings", variables_by_table[feature.table.name]["parameters"])
      self._tfrs_keras_layers_view.add(feature.path, keras_layer)

  def _checkpoint_adapter(self, path: str) -> Any:
    """TF's restore hook, asked before any variable of this layer is bound to the checkpoint.

    Off SparseCore it maps a checkpoint written by tf-recommenders onto this layer's names and
    refuses the whole restore if any table or slot is missing or has another shape (nothing is
    changed then). On SparseCore the sharded tables are TF's stacked variables, which a
    per-table checkpoint (as the other paths write) cannot reach, built or not; off SparseCore,
    per-table variables cannot receive a SparseCore checkpoint's stacks: both refused rather
    than left unrestored.
    """
    sharded = self._sharded
    on_sparse_core = sharded is not None and sharded.execution_path is hardware.ExecutionPath.TPU_V2
    if not on_sparse_core:
      sparse_core.refuse_stacked_tables(
        path,
        {t.name for t in self._config.tables},
        f"the PartialTPUEmbedding layer {self.name!r}",
        f"{_SHARDED_LAYER_KEY}/{checkpoints.TABLES_KEY}",
      )
    if on_sparse_core and sharded.checkpoint_needs_relayout(path):
      names = sorted(name for name, side in self._sides if side == SHARDED)
      raise ValueError(
        f"Cannot restore the checkpoint {path!r} into the PartialTPUEmbedding layer "
        f"{self.name!r}: its sharded tables {names} are on SparseCore (path "
        f"{sharded.execution_path.name}), stacked by TensorFlow, and the checkpoint holds them "
        "in another layout (per table, as the CPU, V0 and V1 paths save them, or other "
        "SparseCore stacking), which this layer cannot convert. Restore such a checkpoint into a "
        "TPUEmbedding layer before it is built, or restore a checkpoint this layer wrote on "
        "SparseCore. Nothing was changed."
      )
    if not on_sparse_core:
      checkpoints.validate(
        self,
        self._config,
        self._table_updates == "engine",
        path,
        layer="PartialTPUEmbedding",
        tables_key=checkpoints.TABLES_KEY,
      )
    return super()._checkpoint_adapter(path)

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    children = super()._trackable_children(save_type, **kwargs)
    if save_type != "checkpoint":
      return children
    if tf.executing_eagerly():
      self.flush()  # a checkpoint holds the tables with every update applied
    children.pop(_TRAP_NAME, None)
    children.pop("_keras_trained_tables", None)
    children.pop("_replicated", None)
    sharded = children.pop("_sharded", None)
    if sharded is not None and self._sharded.execution_path is not hardware.ExecutionPath.CPU:
      children[_SHARDED_LAYER_KEY] = sharded
    children[checkpoints.TABLES_KEY] = self._tables_view
    children["_keras_embedding_layers"] = self._tfrs_keras_layers_view
    return children

  # -------------------------------------------------------------------------------------------
  # Helpers

  def _sharded_shapes(self, input_shape: Any) -> Any:
    """The sharded features' input shapes as the flat dict the sharded layer was given."""
    try:
      shapes = tf_nest.flatten_up_to(self._config.feature_config, input_shape, check_types=False)
    except (TypeError, ValueError):
      return None  # shapes unknown here: the sharded layer detects them on its first call
    return {path: shape for (path, side), shape in zip(self._paths, shapes) if side == SHARDED}

  def _clone_of(self, table: TableConfig) -> TableConfig:
    return self._config.resolve_table(table)


def _sharded_variables(layer: TPUEmbeddingCore) -> dict[str, dict[str, tf.Variable]]:
  """The sharded layer's {table name: {"parameters"/slot: variable}}, on every path."""
  return {
    name: dict(variables)
    for name, variables in layer.variables_by_table.items()
    if isinstance(name, str)
  }


def _refuse_sharding_without_embedding_hardware(sharded_features: list[str]) -> None:
  """On a TPU without embedding hardware TF replicates every table and trains it with the Keras
  optimizer (path V0), so the sharded side could not train as the replicated side does."""
  if hardware.choose_path(tf.distribute.get_strategy()) is hardware.ExecutionPath.TPU_V0:
    raise ValueError(
      f"Features {sharded_features} would be sharded, but this TPU has no embedding hardware "
      "(embedding feature UNSUPPORTED): there is nothing to shard onto. Pass "
      "size_threshold=None to replicate every table (trained by the layer's optimizer), or use "
      "TPUEmbedding."
    )


def _replicated_first(outputs: Any, side_of_path: dict[str, str]) -> Any:
  """A flat dict of outputs in tf-recommenders' order: the replicated features, then the sharded
  ones, each in input order. Code that concatenates `outputs.values()` then builds the same
  columns as with tfrs, so dense weights restored from a tfrs checkpoint line up."""
  if type(outputs) is not dict or not all(key in side_of_path for key in outputs):
    return outputs
  return dict(sorted(outputs.items(), key=lambda item: side_of_path[item[0]] != REPLICATED))
