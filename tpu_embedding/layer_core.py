"""What both Keras flavours of `TPUEmbedding` share: everything but the Keras base class.

`tpu_embedding.layer.TPUEmbedding` (tf-keras) and `tpu_embedding.keras.TPUEmbedding` (Keras 3)
are this mixin over their own `Layer`, so configuration, hardware dispatch, the backend, the
gradient trap and the checkpoint keys are the same objects and code for both. This module
imports no Keras, so neither flavour pulls in the other.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

import tensorflow as tf

from tpu_embedding import (
  backends,
  checkpoint_names,
  hardware,
  optimizers,
  sparse_core,
  tf_restore,
)
from tpu_embedding import config as config_lib
from tpu_embedding import managed_ids as managed_ids_lib
from tpu_embedding.backends import keras_trained
from tpu_embedding.engine import build_once, serving_lookup
from tpu_embedding.preflight import recorder as stats_recorder

TableConfig = tf.tpu.experimental.embedding.TableConfig

TRAP_NAME = "tpu_embedding_helper_dummy"


class RefusesCopies:
  """Refuses `copy.copy`, `copy.deepcopy` and `pickle` of an embedding layer.

  A copy would either share the tables' engine with the original (so that training one trains
  both) or duplicate tables of any size outside TF's checkpointing, and the optimizer state and
  execution path would not follow. The supported way to copy a layer's state is a checkpoint.
  """

  def _refuse_copy(self, how: str) -> None:
    raise TypeError(
      f"{type(self).__name__} layer {getattr(self, 'name', '')!r} cannot be copied with "
      f"{how}: its tables live in TensorFlow variables the copy would not own. Build a new "
      "layer (model) in code and copy the state through a checkpoint: "
      "tf.train.Checkpoint(model=model).save(path), then "
      "tf.train.Checkpoint(model=new_model).restore(path). Nothing was copied."
    )

  def __deepcopy__(self, memo: Any) -> Any:
    self._refuse_copy("copy.deepcopy")

  def __copy__(self) -> Any:
    self._refuse_copy("copy.copy")

  def __reduce_ex__(self, protocol: Any) -> Any:
    self._refuse_copy("pickle")


class TPUEmbeddingCore(RefusesCopies, managed_ids_lib.ManagedIdsMixin, tf_restore.RestoreHook):
  """The layer behaviour, mixed in before a Keras `Layer` class (see the two flavours)."""

  def __init__(
    self,
    feature_config: Any,
    optimizer: Any = None,
    pipeline_execution_with_tensor_core: bool = False,
    batch_size: Optional[int] = None,
    embedding_feature: Optional[hardware.EmbeddingFeature] = None,
    sparse_core_embedding_config: Any = None,
    table_updates: str = "engine",
    check_finite: bool = False,
    execution_path: Optional[hardware.ExecutionPath] = None,
    managed_ids: Optional[Mapping[Any, Any]] = None,
    **kwargs,
  ):
    """`execution_path` is for a layer that holds this one and has already asked the hardware
    (`PartialTPUEmbedding`'s sharded side); by default the path is chosen here from the strategy
    and `embedding_feature`."""
    super().__init__(**kwargs)
    self._config = config_lib.prepare(feature_config, optimizer)
    self._check_finite = check_finite
    self._strategy = tf.distribute.get_strategy()
    if execution_path is None:
      execution_path = hardware.choose_path(self._strategy, embedding_feature)
    self._backend = backends.create(
      execution_path,
      self._config,
      pipelining=pipeline_execution_with_tensor_core,
      batch_size=batch_size,
      sparse_core_embedding_config=sparse_core_embedding_config,
      table_updates=table_updates,
      user_optimizer=optimizer,
      check_finite=check_finite,
    )
    # Tracked under tf-recommenders' name only (not also under the attribute's).
    self._engine = self._no_dependency(self._backend.engine)
    self._track_trackable(self._engine, name=checkpoint_names.TABLES_KEY)
    self.batch_size = batch_size
    if self._backend.table_updates == "keras":  # before the maps create the tables (under PSS)
      keras_trained.refuse_keras3_under_parameter_servers(
        self.name, optimizer, managed_ids_lib.table_names(managed_ids, self._config)
      )
    tables = None  # split with the tables' row blocks, the maps need the tables first
    if managed_ids and managed_ids_lib.splits_maps():
      tables = self._backend.variables_by_table
    self._managed = self._no_dependency(
      managed_ids_lib.create(
        managed_ids,
        self._config,
        self.execution_path,
        pipelining=bool(pipeline_execution_with_tensor_core),
        variables_by_table=tables,
      )
    )
    if self._managed is not None:
      self._track_trackable(self._managed, name=managed_ids_lib.CHECKPOINT_KEY)
      self._write_rows_with(self.row_writer_for(managed_ids_lib.specs(self._managed)))
    if self._backend.table_updates == "engine":  # tables trained by their mid-level optimizers
      optimizers.warn_if_bias_correction_dropped(self._config.tables)
    self._stats_recorder = None

  @property
  def execution_path(self) -> hardware.ExecutionPath:
    """The execution path chosen at construction."""
    return self._backend.path

  @property
  def engine(self) -> tf.Module:
    """The object holding the tables on this path: the CPU/GPU `EmbeddingEngine`, or on TPU
    TF's `TPUEmbeddingV0`, `TPUEmbedding` or `TPUEmbeddingV2` (checkpointed as `_tpu_embedding`,
    the name tf-recommenders gives its mid-level object)."""
    return self._engine

  @build_once
  def build(self, input_shape: Any) -> None:
    self._check_strategy()  # refuse before creating anything under the wrong strategy
    self._backend.build(input_shape)
    if self._backend.table_updates == "engine":
      add_gradient_trap(self, TRAP_NAME)
    else:
      # Replicated or Keras-managed tables must be trainable variables of the model.
      self._keras_trained_tables = self._backend.trainable_tables
    super().build(input_shape)

  def call(
    self,
    features: Any,
    weights: Any = None,
    serving_config: Any = None,
    training: Any = None,
    remapped: bool = False,
  ) -> Any:
    """Activations for `features`. For managed tables (`managed_ids`) the features hold raw
    keys, remapped here (admitting keys unless `training` is False), or rows from `remap`
    when `remapped`."""
    features, guard = self._remap_call(features, weights, training, remapped, serving_config)
    return guard(self._lookup(features, weights, serving_config))

  # No tensor-dependent Python control flow below: converting it would only slow tracing (~10x).
  @tf.autograph.experimental.do_not_convert
  def _lookup(self, features: Any, weights: Any, serving_config: Any) -> Any:
    if serving_config is not None:
      return self._serving_lookup(features, weights, serving_config)
    self._check_strategy()
    if self._stats_recorder is not None:
      self._stats_recorder.record(features)
    trap = getattr(self, TRAP_NAME, None)
    return self._backend.lookup(features, weights, trap)

  def collect_sparse_core_stats(
    self, *, num_chips: int, sparse_cores_per_chip: int = 4, stacking: bool = True
  ) -> None:
    """Counts, from now on, the ids of every training or evaluation lookup as SparseCore on
    `num_chips` chips would (see `tpu_embedding.preflight.sparse_core_stats`; each call's
    features are one global batch); `sparse_core_stats()` reads the maxima. Off by default: it
    adds a host round trip per step (docs/preflight.md measures it). Start it before the first
    call of a compiled step (Keras traces `fit`'s step once); not under `jit_compile`.
    Off TPU only: on SparseCore, TF's own preprocessing counts them."""
    if self.execution_path is not hardware.ExecutionPath.CPU:
      raise ValueError(
        f"collect_sparse_core_stats runs on the CPU/GPU path; this layer is on "
        f"{self.execution_path.value}."
      )
    self._stats_recorder = self._no_dependency(
      stats_recorder.StatsRecorder(
        self._config.feature_config,
        self._config.optimizer,
        num_chips=num_chips,
        sparse_cores_per_chip=sparse_cores_per_chip,
        stacking=stacking,
      )
    )

  def sparse_core_stats(self) -> dict[str, Any]:
    """The SparseCore statistics of the lookups since `collect_sparse_core_stats`, in
    `tpu_embedding.preflight.sparse_core_stats`'s form."""
    if self._stats_recorder is None:
      raise ValueError(
        "This layer collects no SparseCore statistics: call "
        "layer.collect_sparse_core_stats(num_chips=...) before training."
      )
    return self._stats_recorder.result()

  def _serving_lookup(self, features: Any, weights: Any, serving_config: Any) -> Any:
    """A CPU lookup through `serving_config`, reading this layer's current tables."""
    config = config_lib.for_serving(serving_config, self._config)
    return serving_lookup(config, self._backend.embedding_tables, features, weights)

  def _check_strategy(self) -> None:
    current = tf.distribute.get_strategy()
    if current is self._strategy:
      return
    on_tpu = self.execution_path is not hardware.ExecutionPath.CPU
    if on_tpu or hardware.is_tpu_strategy(current) or tf.distribute.has_strategy():
      created, called = hardware.strategy_name(self._strategy), hardware.strategy_name(current)
      if created == called:
        called = (
          f"another {called} object (two strategy objects are two different "
          "strategies, even of one kind)"
        )
      raise RuntimeError(
        f"This TPUEmbedding layer was created under {created} but is called under {called}. "
        "Create the layer (the model) under the strategy you call it with, e.g. inside "
        "strategy.scope(), and call it in strategy.run."
      )

  def row_writer_for(self, managed: Mapping[str, Any]) -> managed_ids_lib.Writer:
    """How rows given to new keys of these tables ({table name: ManagedIds}) are reset on this
    layer's path (a `PartialTPUEmbedding` asks for its sharded tables)."""
    return self._backend.row_writer(managed)

  def flush(self) -> None:
    """Applies updates held back by pipelining and resets of managed rows still waiting (also
    done before every checkpoint save)."""
    self._flush_rows()
    self._backend.flush()

  def update_embedding_table(
    self, table: Union[TableConfig, str], embedding_table: tf.Variable
  ) -> None:
    """Replaces the variable behind `table` (a TableConfig or its name), e.g. with one restored
    elsewhere.

    From then on lookups, training and checkpoints all use `embedding_table`.
    """
    clone = self._clone_of(table)
    current = self.variables_by_table[clone.name]["parameters"]
    if (
      not isinstance(embedding_table, tf.Variable)
      or embedding_table.shape != current.shape
      or embedding_table.dtype != current.dtype
    ):
      raise ValueError(
        f"Table {clone.name!r}: update_embedding_table needs a tf.Variable of shape "
        f"{current.shape.as_list()} and dtype {current.dtype.name} (the table's), got "
        f"{type(embedding_table).__name__} {getattr(embedding_table, 'shape', '')} "
        f"{getattr(getattr(embedding_table, 'dtype', None), 'name', '')}."
      )
    self._backend.replace_table(clone, embedding_table)
    if self._backend.table_updates == "keras" and self.built:
      self._keras_trained_tables = self._backend.trainable_tables

  @property
  def variables_by_table(self) -> dict[str, dict[str, tf.Variable]]:
    """{table name: {"parameters": table, slot name: slot}} on every path."""
    return self._backend.variables_by_table

  def _own_tables(self) -> dict[str, dict[str, tf.Variable]]:
    """The tables a Keras file (`weight_files`) holds for this layer: all of them."""
    return self.variables_by_table

  @property
  def embedding_tables(self) -> dict[TableConfig, tf.Variable]:
    """The table variables, keyed by the user's own TableConfig objects."""
    tables = self._backend.embedding_tables
    return {
      self._config.user_tables[clone]: tables[clone]
      for clone in self._config.tables
      if clone in tables
    }

  @property
  def embedding_config(self) -> config_lib.EmbeddingConfig:
    """The prepared (cloned, validated) configuration this layer was built from."""
    return self._config

  def _clone_of(self, table: Union[TableConfig, str]) -> TableConfig:
    if not isinstance(table, (TableConfig, str)):
      raise TypeError(
        f"Expected one of this layer's TableConfigs (or its name), got "
        f"{type(table).__name__}: {table!r}."
      )
    return self._config.resolve_table(table)

  def checkpoint_needs_relayout(self, path: str) -> bool:
    """Whether the checkpoint at `path` holds this layer's tables in another layout (a per-table
    checkpoint on SparseCore), which TF converts only while it creates the tables."""
    return self._backend.needs_relayout(path)

  def _checkpoint_adapter(self, path: str) -> Any:
    """TF's restore hook, asked before any variable of this layer is bound to the checkpoint:
    refuses a checkpoint that would silently leave the tables unchanged (a SparseCore one off
    SparseCore; one in another layout on SparseCore once the tables exist)."""
    if self.execution_path is not hardware.ExecutionPath.TPU_V2:
      sparse_core.refuse_stacked_tables(
        path,
        {t.name for t in self._config.tables},
        f"the TPUEmbedding layer {self.name!r} (path {self.execution_path.name})",
        checkpoint_names.TABLES_KEY,
      )
    elif self.built and self.checkpoint_needs_relayout(path):
      raise ValueError(
        f"Cannot restore the checkpoint {path!r} into the TPUEmbedding layer {self.name!r} "
        f"(path {self.execution_path.name}) after it is built: the checkpoint holds its tables "
        "in another layout (per table, as the CPU, V0 and V1 paths save them, or other "
        "SparseCore stacking), and TensorFlow converts them only while it creates the "
        "SparseCore variables. Restore before the layer is built, i.e. before its first call or "
        "build() (create the model under the strategy, restore, then train). Nothing was "
        "changed."
      )
    if self._managed is not None:
      managed_ids_lib.validate_checkpoint(self, self._managed, path)
      self._flush_rows(restoring=True)
    return super()._checkpoint_adapter(path)

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    return saved_children(self, super()._trackable_children, TRAP_NAME, save_type, **kwargs)


def saved_children(
  layer: Any, base_children: Callable[..., dict], trap_name: str, save_type: str, **kwargs
) -> dict:
  """The trackable children a checkpoint or a SavedModel (a plain tf.saved_model.save too)
  holds of `layer` (both flavours of both layers), from its Keras base's (`base_children`):
  taken after a flush, so the tables hold every held-back update and every waiting reset of
  managed rows; without the alias of the Keras-trained tables, and in a checkpoint without
  the gradient trap `trap_name` (a SavedModel keeps it: its traced functions capture it)."""
  if tf.executing_eagerly():
    layer.flush()
  children = base_children(save_type, **kwargs)
  if save_type == "checkpoint":
    children.pop(trap_name, None)
  children.pop("_keras_trained_tables", None)
  return children


def add_gradient_trap(layer: Any, name: str) -> None:
  """Gives `layer` the trainable variable `name` that the gradient trap hangs on (see
  `engine.trap`): the Keras model's gradient reaches the tables only through it."""
  trap = layer.add_weight(
    name=name, shape=(1,), initializer="zeros", trainable=True, dtype=tf.float32
  )
  setattr(layer, name, trap)
