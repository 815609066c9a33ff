"""One backend per execution path; the layer holds exactly one and never re-tests the hardware.

Each backend owns the object stored at the layer's `_tpu_embedding` attribute (the checkpoint
path tf-recommenders uses), so a checkpoint's keys are the same on every path.
The TPU backends drive the mid-level API as its documentation prescribes; they cannot run
without a TPU, and their tests check the wiring only.
"""

from __future__ import annotations

import abc
import itertools
from typing import Any, Optional

import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding import hardware
from tpu_embedding.engine.engine import EmbeddingEngine

mid_level = tf.tpu.experimental.embedding  # looked up at call time, so tests can substitute

TABLE_UPDATES = ("engine", "keras")


class Backend(abc.ABC):
  """What the layer needs from an execution path."""

  path: hardware.Path
  needs_trap: bool  # whether the layer must pass a dummy trainable variable to `lookup`

  def __init__(self, config: config_lib.EmbeddingConfig):
    self.config = config

  @property
  @abc.abstractmethod
  def mid_level(self) -> tf.Module:
    """The trackable holding the tables, stored by the layer as `_tpu_embedding`."""

  @abc.abstractmethod
  def build(self, per_replica_input_shapes: Any) -> None:
    ...

  @abc.abstractmethod
  def lookup(self, features: Any, weights: Any, trap: Optional[tf.Variable]) -> Any:
    ...

  @property
  def embedding_tables(self) -> dict:
    return self.mid_level.embedding_tables

  @property
  def variables_by_table(self) -> dict[str, dict[str, tf.Variable]]:
    """{table name: {"parameters": table, slot name: slot}}; TF's classes keep this privately."""
    return self.mid_level._variables  # pylint: disable=protected-access

  def replace_table(self, table: config_lib.TableConfig, variable: tf.Variable) -> None:
    """Makes `variable` the table everywhere; TF's classes track their variables dict."""
    self.variables_by_table[table.name]["parameters"] = variable

  @property
  def trainable_tables(self) -> list[tf.Variable]:
    """Tables the user's optimizer must see as trainable (replicated, Keras-trained tables)."""
    return []

  def flush(self) -> None:
    """Applies any update the hardware still holds back (pipelining); most paths hold none."""


class CpuBackend(Backend):
  """Non-TPU strategies: our engine, TPU-faithful by default."""

  path = hardware.Path.CPU

  def __init__(self, config, pipelining: bool = False, table_updates: str = "engine",
               check_finite: bool = False):
    super().__init__(config)
    if table_updates not in TABLE_UPDATES:
      raise ValueError(f"table_updates={table_updates!r}; expected one of {TABLE_UPDATES}.")
    keras_managed = table_updates == "keras"
    self.needs_trap = not keras_managed
    self._engine = EmbeddingEngine(config, pipelining=pipelining, keras_managed=keras_managed,
                                   check_finite=check_finite)

  @property
  def mid_level(self) -> EmbeddingEngine:
    return self._engine

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
    return [] if self.needs_trap else list(self._engine.embedding_tables.values())

  def flush(self) -> None:
    self._engine.flush()


class TpuV0Backend(Backend):
  """TPU without an embedding accelerator: tables replicated, trained by the Keras optimizer."""

  path = hardware.Path.TPU_V0
  needs_trap = False

  def __init__(self, config):
    super().__init__(config)
    self._mid_level = mid_level.TPUEmbeddingV0(config.feature_config, config.optimizer)

  @property
  def mid_level(self):
    return self._mid_level

  def build(self, per_replica_input_shapes):
    self._mid_level.build()

  def lookup(self, features, weights, trap):
    return self._mid_level(features, weights)

  @property
  def trainable_tables(self) -> list[tf.Variable]:
    return list(self._mid_level.embedding_tables.values())


class TpuV1Backend(Backend):
  """TPU embedding engine: enqueue on the host, dequeue in the step, gradients via the trap."""

  path = hardware.Path.TPU_V1
  needs_trap = True

  def __init__(self, config, pipelining: bool = False, batch_size: Optional[int] = None):
    super().__init__(config)
    self._batch_size = batch_size
    self._mid_level = mid_level.TPUEmbedding(config.feature_config, config.optimizer,
                                             pipelining)
    self._call_ids = itertools.count(1)

  @property
  def mid_level(self):
    return self._mid_level

  def build(self, per_replica_input_shapes):
    if self._batch_size is None:
      self._mid_level.build(per_replica_input_shapes=per_replica_input_shapes)
    else:
      self._mid_level.build(per_replica_batch_size=self._batch_size)

  def lookup(self, features, weights, trap):
    # A name pairs this call's enqueue, dequeue and apply_gradients within one traced step.
    name = str(next(self._call_ids))
    self._mid_level.enqueue(features, weights, training=True, name=name)

    @tf.custom_gradient
    def gradient_trap(dummy):
      activations = tf.nest.flatten(self._mid_level.dequeue(name=name))

      def grad(*upstream):
        self._mid_level.apply_gradients(
            tf.nest.pack_sequence_as(self.config.feature_config, list(upstream)), name=name)
        return tf.zeros_like(dummy)

      return activations, grad

    return tf.nest.pack_sequence_as(self.config.feature_config, gradient_trap(trap))


class TpuV2Backend(Backend):
  """SparseCore: one call does enqueue+dequeue; gradients go back with the preserved state."""

  path = hardware.Path.TPU_V2
  needs_trap = True

  def __init__(self, config, pipelining: bool = False, sparse_core_embedding_config=None):
    super().__init__(config)
    self._mid_level = mid_level.TPUEmbeddingV2(config.feature_config, config.optimizer,
                                               pipelining, sparse_core_embedding_config)

  @property
  def mid_level(self):
    return self._mid_level

  def build(self, per_replica_input_shapes):
    self._mid_level.build()

  @property
  def embedding_tables(self) -> dict:
    """{TableConfig: variable}; TPUEmbeddingV2 itself keys its tables by *stacked* table name.

    A table stacked alone maps to its stack's variable. Several tables sharing one stack have no
    variable of their own, which is refused by name rather than silently left out.
    """
    stacked = self._mid_level.embedding_tables
    layouts = self._mid_level.embedding_layouts
    stack_of = {table: layouts[table.name].stacked_table_name for table in self.config.tables}
    members: dict[str, list[str]] = {}
    for table, stack in stack_of.items():
      members.setdefault(stack, []).append(table.name)
    shared = {stack: names for stack, names in members.items() if len(names) > 1}
    if shared:
      raise ValueError(
          f"On SparseCore these tables are stacked into shared variables: {shared}; no table has "
          "a variable of its own. Pass sparse_core_embedding_config=tf.tpu.experimental."
          "embedding.SparseCoreEmbeddingConfig(disable_table_stacking=True) to keep them apart, "
          "or read the stacked variables from layer._tpu_embedding.embedding_tables.")
    return {table: stacked[stack] for table, stack in stack_of.items()}

  def lookup(self, features, weights, trap):
    @tf.custom_gradient
    def gradient_trap(dummy):
      activations, preserved = self._mid_level(features, weights)

      def grad(*upstream):
        self._mid_level.apply_gradients(
            tf.nest.pack_sequence_as(self.config.feature_config, list(upstream)),
            preserved_outputs=preserved)
        return tf.zeros_like(dummy)

      return tf.nest.flatten(activations), grad

    return tf.nest.pack_sequence_as(self.config.feature_config, gradient_trap(trap))


def create(path: hardware.Path, config: config_lib.EmbeddingConfig, *, pipelining: bool,
           batch_size: Optional[int], sparse_core_embedding_config,
           table_updates: str, check_finite: bool = False) -> Backend:
  """The backend for `path`, with the arguments that path takes."""
  if path is hardware.Path.CPU:
    return CpuBackend(config, pipelining=pipelining, table_updates=table_updates,
                      check_finite=check_finite)
  if check_finite:
    raise ValueError(
        f"check_finite=True is an option of the CPU/GPU engine; on {path.name} the TPU updates "
        "the tables itself and cannot stop at a non-finite value. Leave it off under a "
        "TPUStrategy (e.g. TPUEmbedding(..., check_finite=not on_tpu)).")
  if path is hardware.Path.TPU_V0:
    return TpuV0Backend(config)
  if path is hardware.Path.TPU_V1:
    return TpuV1Backend(config, pipelining=pipelining, batch_size=batch_size)
  return TpuV2Backend(config, pipelining=pipelining,
                      sparse_core_embedding_config=sparse_core_embedding_config)
