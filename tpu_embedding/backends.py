"""One backend per execution path; the layer holds exactly one and never re-tests the hardware.

Each backend owns the path's `engine`, the object holding the tables: our `EmbeddingEngine` off
TPU, TF's mid-level object on TPU. The layer saves it under `_tpu_embedding` (the checkpoint key
tf-recommenders uses), so a table's checkpoint key is the same on the CPU, V0 and V1 paths;
SparseCore saves stacked tables instead (see `tpu_embedding.sparse_core`).
The TPU backends drive TF's mid-level classes as their documentation prescribes; their tests run
those real classes with only the TPU runtime stubbed (tests/tpu_harness.py).
"""

from __future__ import annotations

import abc
import copy
import itertools
import typing
from typing import Any, Optional

import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding import hardware
from tpu_embedding import optimizers
from tpu_embedding import sparse_core
from tpu_embedding import tf_internals
from tpu_embedding import tf_mid_level
from tpu_embedding.engine.engine import EmbeddingEngine

_PACKING = tf_internals.PackingStatus

_embedding = tf.tpu.experimental.embedding

# Who updates the tables (the layers' `table_updates`): "engine", each table's own mid-level
# optimizer, reached through the gradient trap; "keras", the Keras optimizer the model applies
# to the tables as trainable variables.
TABLE_UPDATES = ("engine", "keras")


class Backend(abc.ABC):
  """What the layer needs from an execution path."""

  path: hardware.ExecutionPath
  table_updates: str  # one of TABLE_UPDATES; "engine" needs the gradient trap in `lookup`

  def __init__(self, config: config_lib.EmbeddingConfig):
    self.config = config

  _engine: tf.Module  # set by each backend's constructor

  @property
  def engine(self) -> tf.Module:
    """The trackable holding (and on most paths training) the tables: our `EmbeddingEngine`
    off TPU, TF's mid-level `TPUEmbeddingV0`/`TPUEmbedding`/`TPUEmbeddingV2` on TPU."""
    return self._engine

  @abc.abstractmethod
  def build(self, per_replica_input_shapes: Any) -> None: ...

  @abc.abstractmethod
  def lookup(self, features: Any, weights: Any, trap: Optional[tf.Variable]) -> Any: ...

  @property
  def embedding_tables(self) -> dict:
    return self.engine.embedding_tables

  @property
  def variables_by_table(self) -> dict[str, dict[str, tf.Variable]]:
    """{table name: {"parameters": table, slot name: slot}}, the engine's own dict."""
    return tf_mid_level.variables_by_table(self.engine)

  def replace_table(self, table: config_lib.TableConfig, variable: tf.Variable) -> None:
    """Makes `variable` the table everywhere; TF's classes track their variables dict."""
    self.variables_by_table[table.name]["parameters"] = variable

  @property
  def trainable_tables(self) -> list[tf.Variable]:
    """Tables the user's optimizer must see as trainable (replicated, Keras-trained tables)."""
    return []

  def flush(self) -> None:
    """Applies any update the hardware still holds back (pipelining); most paths hold none."""

  def needs_relayout(self, path: str) -> bool:
    """Whether the checkpoint at `path` holds the tables in a layout that TF converts only while
    it creates the variables (SparseCore); every other path restores per table at any time."""
    return False


class CpuBackend(Backend):
  """Non-TPU strategies: our engine, TPU-faithful by default."""

  path = hardware.ExecutionPath.CPU

  def __init__(
    self,
    config,
    pipelining: bool = False,
    table_updates: str = "engine",
    check_finite: bool = False,
  ):
    super().__init__(config)
    if table_updates not in TABLE_UPDATES:
      raise ValueError(f"table_updates={table_updates!r}; expected one of {TABLE_UPDATES}.")
    self.table_updates = table_updates
    self._engine = EmbeddingEngine(
      config, pipelining=pipelining, table_updates=table_updates, check_finite=check_finite
    )

  def build(self, per_replica_input_shapes: Any) -> None:
    self._engine.build()

  def lookup(self, features, weights, trap):
    return self._engine.lookup(features, weights, trap)

  @property
  def embedding_tables(self) -> dict:
    return self._engine.embedding_tables

  @property
  def variables_by_table(self) -> dict[str, dict[str, tf.Variable]]:
    return self._engine.variables_by_table

  def replace_table(self, table: config_lib.TableConfig, variable: tf.Variable) -> None:
    self._engine.replace_table(table, variable)

  @property
  def trainable_tables(self) -> list[tf.Variable]:
    return [] if self.table_updates == "engine" else list(self._engine.embedding_tables.values())

  def flush(self) -> None:
    self._engine.flush()


class TpuV0Backend(Backend):
  """TPU without an embedding accelerator: replicated tables, trained by the Keras optimizer.

  TF's V0 class only looks rows up; the tables are ordinary trainable variables that the
  optimizer the model applies updates (Keras semantics, as in tf-recommenders). A mid-level
  optimizer, whose TPU update rule V0 cannot give, is therefore refused rather than ignored,
  and no slot variables are created (TF would create them and never update them).
  """

  path = hardware.ExecutionPath.TPU_V0
  table_updates = "keras"

  def __init__(self, config, user_optimizer: Any = None):
    super().__init__(config)
    _refuse_mid_level_optimizers(config, user_optimizer)
    for table in config.tables:
      table.optimizer = None  # slots would live in the Keras optimizer, not here
    self._engine = _embedding.TPUEmbeddingV0(config.feature_config, None)

  def build(self, per_replica_input_shapes):
    self._engine.build()

  def lookup(self, features, weights, trap):
    activations = self._engine(features, weights)
    return tf.nest.pack_sequence_as(
      self.config.feature_config,
      [
        _as_other_paths_give(feature, ids, out)
        for (feature, ids), out in zip(
          config_lib.match_structure(self.config, features), tf.nest.flatten(activations)
        )
      ],
    )

  @property
  def trainable_tables(self) -> list[tf.Variable]:
    return list(self._engine.embedding_tables.values())


def _as_other_paths_give(feature: config_lib.Feature, ids: Any, out: tf.Tensor) -> tf.Tensor:
  """Two differences of TF's V0 class from every other path, undone: it keeps the trailing 1 of
  dense [B, 1] ids ([B, 1, D], not [B, D]), and it looks the padding of a short ragged or sparse
  sequence up as id 0 (row 0's values, not zeros)."""
  if (
    isinstance(ids, tf.Tensor)
    and ids.shape.rank is not None
    and ids.shape.rank >= 2
    and ids.shape[-1] == 1
  ):
    return tf.squeeze(out, -2)
  length = feature.config.max_sequence_length
  if not length or isinstance(ids, tf.Tensor):
    return out
  if isinstance(ids, tf.RaggedTensor):
    present = tf.sequence_mask(ids.row_lengths(), length)
  else:
    positions = tf.SparseTensor(ids.indices, tf.ones_like(ids.values, tf.bool), ids.dense_shape)
    present = tf.sparse.to_dense(
      tf.sparse.slice(positions, [0, 0], tf.stack([ids.dense_shape[0], length])),
      default_value=False,
    )
    present = tf.pad(present, [[0, 0], [0, length - tf.shape(present)[1]]])
  return out * tf.cast(present, out.dtype)[:, :, None]


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


class TpuV1Backend(Backend):
  """TPU embedding engine: enqueue on the host, dequeue in the step, gradients via the trap."""

  path = hardware.ExecutionPath.TPU_V1
  table_updates = "engine"

  def __init__(self, config, pipelining: bool = False, batch_size: Optional[int] = None):
    super().__init__(config)
    self._batch_size = batch_size
    _require_optimizers(config, self.path)
    _give_packing_status_as_enum(config)
    self._engine = _embedding.TPUEmbedding(config.feature_config, config.optimizer, pipelining)
    self._call_ids = itertools.count(1)

  @property
  def embedding_tables(self) -> dict:
    """{TableConfig: variable}, refreshed from TPU memory first.

    TF's class answers only while a checkpoint is written (its host copies are stale in
    between), so the tables are retrieved as a save would, eagerly even inside a trace.
    """
    with tf.init_scope():
      tf_mid_level.retrieve_from_tpu(self._engine)
    variables = self.variables_by_table
    return {table: variables[table.name]["parameters"] for table in self.config.tables}

  def flush(self) -> None:
    """Copies the tables and slots from TPU memory into their host variables, so that what
    export reads is current (TF's own checkpoint saver does the same before a save)."""
    tf_mid_level.retrieve_from_tpu(self._engine)

  def build(self, per_replica_input_shapes):
    if self._batch_size is None:
      self._engine.build(per_replica_input_shapes=per_replica_input_shapes)
    else:
      self._engine.build(per_replica_batch_size=self._batch_size)

  def lookup(self, features, weights, trap):
    _refuse_wide_dense_ids(self.config, features)
    # A name pairs this call's enqueue, dequeue and apply_gradients within one traced step.
    name = str(next(self._call_ids))
    self._engine.enqueue(features, weights, training=True, name=name)

    @tf.custom_gradient
    def gradient_trap(dummy):
      activations = tf.nest.flatten(self._engine.dequeue(name=name))

      def grad(*upstream):
        self._engine.apply_gradients(
          tf.nest.pack_sequence_as(self.config.feature_config, list(upstream)), name=name
        )
        return tf.zeros_like(dummy)

      return activations, grad

    return tf.nest.pack_sequence_as(self.config.feature_config, gradient_trap(trap))


def _require_optimizers(config: config_lib.EmbeddingConfig, path: hardware.ExecutionPath) -> None:
  missing = [table.name for table in config.tables if table.optimizer is None]
  if missing:
    raise ValueError(
      f"Tables {missing} have no optimizer, but on path {path.name} the TPU trains every "
      "table with its own mid-level optimizer. optimizer=None is only for serving-only layers "
      "off TPU: pass optimizer= (or TableConfig.optimizer)."
    )


def _refuse_wide_dense_ids(config: config_lib.EmbeddingConfig, features: Any) -> None:
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


def _give_packing_status_as_enum(config: config_lib.EmbeddingConfig) -> None:
  """Gives each cloned table a copy of its optimizer whose packing status is the proto's enum.

  TF's V1 class writes `optimizer.low_dimensional_packing_status` verbatim into an enum field of
  `OptimizationParameters`; its default (the bool False) is refused by protobuf >= 5, so every
  V1 `build()` would fail. The enum value with the same meaning (False -> UNSPECIFIED, the
  field's default; True -> ENABLED) builds the same proto. Copies keep the user's optimizer
  untouched; tables that shared one optimizer still share one copy.
  """
  copies: dict[int, Any] = {}
  for table in config.tables:
    optimizer = table.optimizer
    if optimizer is None or not isinstance(optimizer.low_dimensional_packing_status, bool):
      continue
    if id(optimizer) not in copies:
      fixed = copy.copy(optimizer)
      fixed.low_dimensional_packing_status = (
        _PACKING.ENABLED if optimizer.low_dimensional_packing_status else _PACKING.UNSPECIFIED
      )
      copies[id(optimizer)] = fixed
    table.optimizer = copies[id(optimizer)]


class TpuV2Backend(Backend):
  """SparseCore: one call does enqueue+dequeue; gradients go back with the preserved state."""

  path = hardware.ExecutionPath.TPU_V2
  table_updates = "engine"

  def __init__(self, config, pipelining: bool = False, sparse_core_embedding_config=None):
    super().__init__(config)
    _require_optimizers(config, self.path)
    _require_output_shapes(config)
    _refuse_what_sparse_core_ignores(config)
    self._engine = _embedding.TPUEmbeddingV2(
      config.feature_config, config.optimizer, pipelining, sparse_core_embedding_config
    )

  def build(self, per_replica_input_shapes):
    self._engine.build()

  @property
  def embedding_tables(self) -> dict:
    """{TableConfig: tensor}: each table's logical value, whether stacked or alone.

    TPUEmbeddingV2 keys its variables by stacked table name, and even a table stacked alone is
    padded, row-dealt and rotated over the SparseCores; these are read-only copies of the
    tables as configured (write through a checkpoint restore, not through these).
    """
    return sparse_core.logical_tables(
      self._engine.embedding_tables, self._engine.embedding_layouts, self.config.tables
    )

  @property
  def variables_by_table(self) -> dict[str, dict[str, tf.Variable]]:
    """{stacked table name: {"parameters"/slot: variable}}: SparseCore keeps them by stack."""
    return self._engine.variables

  def needs_relayout(self, path: str) -> bool:
    return sparse_core.needs_relayout(path, self._engine)

  def lookup(self, features, weights, trap):
    @tf.custom_gradient
    def gradient_trap(dummy):
      activations, preserved = self._engine(features, weights)

      def grad(*upstream):
        self._engine.apply_gradients(
          tf.nest.pack_sequence_as(self.config.feature_config, list(upstream)),
          preserved_outputs=preserved,
        )
        return tf.zeros_like(dummy)

      return tf.nest.flatten(activations), grad

    return tf.nest.pack_sequence_as(self.config.feature_config, gradient_trap(trap))


def _require_output_shapes(config: config_lib.EmbeddingConfig) -> None:
  missing = [f.name for f in config.features if not f.config.output_shape.is_fully_defined()]
  if missing:
    raise ValueError(
      f"Features {missing} have no fully defined FeatureConfig.output_shape, but on path "
      f"{hardware.ExecutionPath.TPU_V2.name} (SparseCore) TensorFlow cannot derive output shapes from "
      "the inputs: set output_shape=[per-replica batch size] (or [batch, sequence length])."
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
          f"{hardware.ExecutionPath.TPU_V2.name}) does not apply: TensorFlow's SparseCore update has no "
          "gradient clipping, weight clipping or weight decay. Remove the setting for this "
          "path (the CPU, V1 and Keras paths apply it)."
        )


def create(
  path: hardware.ExecutionPath,
  config: config_lib.EmbeddingConfig,
  *,
  pipelining: bool,
  batch_size: Optional[int],
  sparse_core_embedding_config,
  table_updates: str,
  user_optimizer: Any = None,
  check_finite: bool = False,
) -> Backend:
  """The backend for `path`, with the arguments that path takes."""
  if not isinstance(check_finite, bool):  # a truthy string would silently enable it
    raise TypeError(f"check_finite={check_finite!r}; expected True or False.")
  if path is hardware.ExecutionPath.CPU:
    return CpuBackend(
      config, pipelining=pipelining, table_updates=table_updates, check_finite=check_finite
    )
  if check_finite:
    raise ValueError(
      f"check_finite=True is an option of the CPU/GPU engine; on {path.name} the TPU updates "
      "the tables itself and cannot stop at a non-finite value. Leave it off under a "
      "TPUStrategy (e.g. TPUEmbedding(..., check_finite=not on_tpu))."
    )
  if path is hardware.ExecutionPath.TPU_V0:
    return TpuV0Backend(config, user_optimizer)
  if path is hardware.ExecutionPath.TPU_V1:
    return TpuV1Backend(config, pipelining=pipelining, batch_size=batch_size)
  return TpuV2Backend(
    config, pipelining=pipelining, sparse_core_embedding_config=sparse_core_embedding_config
  )
