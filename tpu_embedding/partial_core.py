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
from typing import Any, Optional

import tensorflow as tf

from tpu_embedding import (
  backends,
  checkpoint_names,
  checkpoint_views,
  checkpoints,
  hardware,
  optimizers,
  sparse_core,
  tf_internals,
  tf_restore,
)
from tpu_embedding import config as config_lib
from tpu_embedding import managed_ids as managed_ids_lib
from tpu_embedding import placement as placement_lib
from tpu_embedding.backends import row_writers
from tpu_embedding.engine import build_once, joint_step
from tpu_embedding.layer_core import (
  RefusesCopies,
  TPUEmbeddingCore,
  add_gradient_trap,
  saved_children,
)
from tpu_embedding.placement import REPLICATED, SHARDED, Placement, TablePlacement

__all__ = [
  "REPLICATED",
  "SHARDED",
  "PartialTPUEmbeddingCore",
  "Placement",
  "ReplicatedTable",
  "TablePlacement",
]

TableConfig = tf.tpu.experimental.embedding.TableConfig

_TRAP_NAME = "partial_embedding_helper_dummy"


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


# ---------------------------------------------------------------------------------------------
# The layer


class PartialTPUEmbeddingCore(
  RefusesCopies, managed_ids_lib.ManagedIdsMixin, tf_restore.RestoreHook
):
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
    check_finite: bool = False,
    sparse_core_embedding_config: Any = None,
    managed_ids: Any = None,
    **kwargs,
  ):
    super().__init__(**kwargs)
    backends.check_layer_options(
      hardware.ExecutionPath.CPU, table_updates, check_finite, batch_size
    )
    self._table_updates = table_updates
    self._check_finite = check_finite
    self._size_threshold = size_threshold
    self._config = config_lib.prepare(feature_config, optimizer)  # names every table once
    self._sides = self._choose_sides(size_threshold)
    # Each side gets a flat {feature path: cloned FeatureConfig}; the clones already carry the
    # names and optimizers resolved over the whole nest, so names never depend on the threshold.
    per_side = {REPLICATED: {}, SHARDED: {}}
    for feature in self._config.features:
      per_side[self._sides[feature.table.name]][feature.path] = feature.config
    self._paths = tuple((f.path, self._sides[f.table.name]) for f in self._config.features)

    if table_updates == "engine":  # one warning naming both sides' tables (the sharded
      optimizers.warn_if_bias_correction_dropped(self._config.tables)  # layer's is then silent)
    # The hardware is asked once for the whole layer: the sharded side and the managed ids use it.
    path = placement_lib.sharded_path(tf.distribute.get_strategy(), sorted(per_side[SHARDED]))
    self._sharded = None  # the TPUEmbedding layer serving the sharded tables
    if per_side[SHARDED]:
      self._sharded = self.sharded_layer_class(
        per_side[SHARDED],
        self._config.optimizer,
        pipeline_execution_with_tensor_core=pipeline_execution_with_tensor_core,
        batch_size=batch_size,
        table_updates=table_updates,
        check_finite=check_finite,
        sparse_core_embedding_config=sparse_core_embedding_config,
        execution_path=path,
        name="sharded_embedding",
      )
      if self._sharded.execution_path is hardware.ExecutionPath.CPU:
        self._sharded.build(None)  # needs no shapes off TPU: tables exist from the start

    # The replicated side is the CPU/GPU engine, whatever the hardware, and needs no shapes:
    # built now, under the strategy in scope, so its variables are that strategy's replicated
    # variables (TensorCore memory on TPU).
    self._replicated = None
    if per_side[REPLICATED]:
      replicated = backends.create(
        hardware.ExecutionPath.CPU,
        config_lib.prepare(per_side[REPLICATED], self._config.optimizer),
        pipelining=False,
        batch_size=None,
        sparse_core_embedding_config=None,
        table_updates=table_updates,
        user_optimizer=optimizer,  # holds the slots of tables trained by table_updates="keras"
        check_finite=check_finite,
      )
      replicated.build(None)
      self._replicated = replicated.engine
      self._replicated_backend = self._no_dependency(replicated)  # resets its managed rows

    # Maps over all tables, whatever their side: the call remaps before splitting by side
    # (under parameter servers, split with the tables' row blocks: both sides are built now).
    splits = managed_ids and managed_ids_lib.splits_maps()
    self._managed = self._no_dependency(
      managed_ids_lib.create(
        managed_ids,
        self._config,
        path,
        pipelining=bool(pipeline_execution_with_tensor_core),
        variables_by_table=self.variables_by_table if splits else None,
      )
    )
    if self._managed is not None:
      self._track_trackable(self._managed, name=managed_ids_lib.CHECKPOINT_KEY)
      self._write_rows_with(self._managed_row_writer(managed_ids_lib.specs(self._managed)))

    self._checkpoint_views = self._no_dependency(checkpoint_views.PartialLayerViews())
    self._track_tables()

  def _managed_row_writer(self, specs: dict[str, Any]) -> row_writers.RoutedWriter:
    """Each managed table's resets go where its side keeps it: the sharded layer's path, or
    the replicated side's backend (its engine's variables, or the Keras optimizer's slots with
    table_updates="keras")."""
    by_table = {}
    for side, resets_for in (
      (SHARDED, lambda chosen: self._sharded.row_writer_for(chosen)),
      (REPLICATED, lambda chosen: self._replicated_backend.row_writer(chosen)),
    ):
      chosen = {name: spec for name, spec in specs.items() if self._sides[name] == side}
      if chosen:
        writer = resets_for(chosen)
        by_table.update({name: writer for name in chosen})
    return row_writers.RoutedWriter(by_table)

  def _choose_sides(self, size_threshold: Optional[int]) -> dict[str, str]:
    """{table name: side}: by `size_threshold` here; a subclass may decide otherwise."""
    return placement_lib.sides(self._config, size_threshold)

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

  @property
  def embedding_config(self) -> config_lib.EmbeddingConfig:
    """The prepared (cloned, validated) configuration of both sides, as `TPUEmbedding`'s."""
    return self._config

  def side(self, table: Any) -> str:
    """`"replicated"` or `"sharded"` for a table name or one of the user's TableConfigs."""
    name = table if isinstance(table, str) else self._clone_of(table).name
    if name not in self._sides:
      raise ValueError(f"No table named {name!r}; tables: {list(self._sides)}.")
    return self._sides[name]

  def placement(self, num_replicas: int = 1) -> Placement:
    """Each table's side and float32 bytes (table + slots), in total and per device: see
    `tpu_embedding.placement.report`."""
    return placement_lib.report(self._config, self._sides, self._size_threshold, num_replicas)

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
    """Applies sharded-side updates held back by pipelining (replicated ones never are) and
    resets of managed rows still waiting."""
    self._flush_rows()
    if self._sharded is not None:
      self._sharded.flush()

  # -------------------------------------------------------------------------------------------
  # Keras

  @build_once
  def build(self, input_shape: Any) -> None:
    if self._sharded is not None and not self._sharded.built:
      self._sharded.build(self._sharded_shapes(input_shape))
    if self._replicated is not None and self._table_updates == "keras":
      # Keras-trained tables must be trainable variables of the model (one per table).
      self._keras_trained_tables = list(self._replicated.embedding_tables.values())
    elif self._replicated is not None:
      add_gradient_trap(self, _TRAP_NAME)
    self._track_tables()
    super().build(input_shape)

  def call(
    self, features: Any, weights: Any = None, training: Any = None, remapped: bool = False
  ) -> Any:
    features, guard = self._remap_call(features, weights, training, remapped)
    return guard(self._lookup(features, weights))

  # Plain Python over the features, no tensor-dependent control flow: AutoGraph (which tf-keras
  # and Keras 3 apply to a model's call inside `fit`) would convert every function it reaches,
  # the whole engine included, and that conversion cost most of the first step.
  @tf.autograph.experimental.do_not_convert
  def _lookup(self, features: Any, weights: Any) -> Any:
    pairs = config_lib.match_structure(self._config, features)
    weight_leaves = config_lib.weight_leaves(features, weights, len(pairs))
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
    # With check_finite, every check of both sides runs before either side writes.
    with joint_step() as step:
      if inputs[SHARDED]:
        outputs.update(self._sharded(inputs[SHARDED], weights=side_weights(SHARDED)))
      if inputs[REPLICATED]:
        outputs.update(
          self._replicated.lookup(
            inputs[REPLICATED], side_weights(REPLICATED), getattr(self, _TRAP_NAME, None)
          )
        )
    outputs = step.guard(outputs)
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

  def _own_tables(self) -> dict[str, dict[str, tf.Variable]]:
    """The tables a Keras file (`weight_files`) holds for this layer: the replicated ones (the
    sharded side is a Keras sublayer, which Keras saves on its own)."""
    return {} if self._replicated is None else self._replicated.variables_by_table

  def _track_tables(self) -> None:
    """Registers every existing table and slot under this package's names and tf-recommenders'
    (`checkpoint_views`). Tracking (rather than only listing them at save time) lets a restore
    issued before the tables exist wait for them: the value is applied when the name is tracked
    here."""
    self._checkpoint_views.track(self.variables_by_table, self._config.features)

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
        f"{checkpoint_names.SHARDED_LAYER_KEY}/{checkpoint_names.TABLES_KEY}",
      )
    if on_sparse_core and sharded.checkpoint_needs_relayout(path):
      names = sorted(name for name, side in self._sides.items() if side == SHARDED)
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
        tables_key=checkpoint_names.TABLES_KEY,
      )
    if self._managed is not None:
      managed_ids_lib.validate_checkpoint(self, self._managed, path)
      self._flush_rows(restoring=True)
    return super()._checkpoint_adapter(path)

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    children = saved_children(self, super()._trackable_children, _TRAP_NAME, save_type, **kwargs)
    if save_type != "checkpoint":
      return children
    children.pop("_replicated", None)
    sharded = children.pop("_sharded", None)
    if sharded is not None and self._sharded.execution_path is not hardware.ExecutionPath.CPU:
      children[checkpoint_names.SHARDED_LAYER_KEY] = sharded
    children.update(self._checkpoint_views.children())
    return children

  # -------------------------------------------------------------------------------------------
  # Helpers

  def _sharded_shapes(self, input_shape: Any) -> Any:
    """The sharded features' input shapes as the flat dict the sharded layer was given."""
    try:
      shapes = tf_internals.flatten_up_to(self._config.feature_config, input_shape)
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


def _replicated_first(outputs: Any, side_of_path: dict[str, str]) -> Any:
  """A flat dict of outputs in tf-recommenders' order: the replicated features, then the sharded
  ones, each in input order. Code that concatenates `outputs.values()` then builds the same
  columns as with tfrs, so dense weights restored from a tfrs checkpoint line up."""
  if type(outputs) is not dict or not all(key in side_of_path for key in outputs):
    return outputs
  return dict(sorted(outputs.items(), key=lambda item: side_of_path[item[0]] != REPLICATED))
