"""The CPU/GPU embedding engine: tables trained the way the TPU embedding engine trains them.

The layer hands activations to the model through a gradient trap (as on TPU): when the user's
`tape.gradient` reaches the activations, the engine assembles each touched row's summed gradient
and applies the table's own mid-level optimizer to those rows only. Dense variables are still
updated by the user's optimizer; tables never appear as trainable variables, so the user's
optimizer never touches (or decays) them.

Variables are registered under the mid-level API's names (`<table>` and `<table>/<slot>`), so a
checkpoint written here restores into `TPUEmbedding`, `TPUEmbeddingForServing` and back.
"""

from __future__ import annotations

import collections
import warnings
import weakref
from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

from tpu_embedding import (
  checkpoint_names,
  checkpoints,
  optimizers,
  tf_internals,
  tf_restore,
)
from tpu_embedding import config as config_lib
from tpu_embedding.engine import backward, exchange, finite, inputs, lookup, sharded, static_path
from tpu_embedding.engine import trap as trap_lib
from tpu_embedding.engine import variables as variables_lib
from tpu_embedding.engine.builds import build_once
from tpu_embedding.engine.distribution import Distribution

TableConfig = tf.tpu.experimental.embedding.TableConfig

SECOND_GRADIENT_WARNING = (
  "tpu_embedding: the activations of one TPUEmbedding call received a second gradient (e.g. "
  "a persistent GradientTape asked twice); each gradient that reaches the activations "
  "updates the tables, so this step updated them again. Take one tape.gradient per step "
  "with respect to all trainable variables (see docs/engine.md: the gradient trap's contract)."
)


class EmbeddingEngine(tf_restore.RestoreHook, tf.Module):
  """Owns the tables and slots and performs lookups and sparse updates on CPU or GPU.

  Args:
    config: the prepared feature configuration.
    pipelining: emulate `pipeline_execution_with_tensor_core=True`: a step's lookups see the
      tables without the previous step's update, as on TPU.
    table_updates: "engine" (each table's mid-level optimizer, through the trap) or "keras":
      tables are trainable variables updated by the user's Keras optimizer (the
      tf-recommenders behaviour); no slots are created and no trap is used.
    check_finite: raise at the first non-finite gradient, weight or learning rate on its way
      to a table (`finite`), instead of letting it poison the rows as the TPU does.
  """

  # Pipelining buffers are engine state, not model weights: keep them out of `variables`.
  _TF_MODULE_IGNORED_PROPERTIES = frozenset({"_updates", "_training_lookups"}).union(
    tf.Module._TF_MODULE_IGNORED_PROPERTIES
  )

  def __init__(
    self,
    config: config_lib.EmbeddingConfig,
    pipelining: bool = False,
    table_updates: str = "engine",
    check_finite: bool = False,
  ):
    super().__init__(name="embedding_engine")
    self._config = self._no_dependency(config)
    self._pipelining = pipelining
    self._updates_tables = table_updates == "engine"  # else Keras's optimizer does
    self._check_finite = check_finite
    self._follows_keras_optimizer = any(
      optimizers.follows_keras_optimizer(table.optimizer) for table in config.tables
    )
    self._variables: dict[str, dict[str, tf.Variable]] = self._no_dependency({})
    # Per graph being traced: how many training lookups read each table (see
    # `_register_training_lookup`).
    self._training_lookups = self._no_dependency(weakref.WeakKeyDictionary())
    self._built = False
    self._strategy = tf.distribute.get_strategy()  # tables are created under it, as TF does
    self._distribution = Distribution.current()
    self._updates = backward.TableUpdates(
      self._variables, pipelining, check_finite, self._distribution
    )

  # -------------------------------------------------------------------------------------------
  # Variables

  @property
  def built(self) -> bool:
    return self._built

  @build_once
  def build(self) -> None:
    """Creates every table (and its slots) once, outside any function being traced."""
    with tf.init_scope():
      if tf.distribute.has_strategy():
        self._create_tables()
      else:
        with self._strategy.scope():
          self._create_tables()
    self._built = True

  def _create_tables(self) -> None:
    for table in self._config.tables:
      self._create_table(table)

  def _create_table(self, table: TableConfig) -> None:
    parameters = variables_lib.new_table(table, not self._updates_tables, self._check_finite)
    self._variables[table.name] = {"parameters": parameters}
    self._track_trackable(parameters, name=table.name)
    if self._updates_tables:
      # Trained here, not watched by tapes; a reloaded SavedModel's tables are plain trainable
      # variables, as tf-recommenders' are, which only an optimizer the user applies changes.
      for shard in sharded.shards(parameters):
        tf_internals.saved_as_trainable(shard)
    if table.optimizer is not None and self._updates_tables:
      self._variables[table.name].update(self._create_slots(table, parameters))
      self._updates.add(table)

  def _create_slots(self, table: TableConfig, parameters: tf.Variable) -> dict[str, tf.Variable]:
    on_parameter_servers = self._distribution is Distribution.PARAMETER_SERVERS
    slots = variables_lib.new_slots(table, parameters, on_parameter_servers, self._check_finite)
    if variables_lib.slot_creator(table) is None:  # else the optimizer's creator tracks them
      for name, slot in slots.items():
        self._track_trackable(slot, name=checkpoint_names.variable_key(table.name, name))
    return slots

  def _checkpoint_adapter(self, path: str):
    # TF's per-object restore hook, called before any table or slot of this engine is bound:
    # refuse the whole restore here if any of them is missing or has another shape.
    checkpoints.validate(self, self._config, self._updates_tables, path)
    return super()._checkpoint_adapter(path)

  @property
  def variables_by_table(self) -> dict[str, dict[str, tf.Variable]]:
    """{table name: {"parameters": table, slot name: slot}}, as the mid-level `variables`."""
    self.build()
    return self._variables

  def replace_table(self, table: TableConfig, variable: tf.Variable) -> None:
    """Makes `variable` the table for lookups, updates and checkpoints alike."""
    self.build()
    self._updates.flush()  # updates held back belong to the variable being replaced
    self._variables[table.name]["parameters"] = variable
    self._track_trackable(variable, name=table.name, overwrite=True)

  @property
  def embedding_tables(self) -> dict[TableConfig, tf.Variable]:
    self.build()
    return {t: self._variables[t.name]["parameters"] for t in self._config.tables}

  # -------------------------------------------------------------------------------------------
  # Lookup

  # Not converted by AutoGraph (see `PartialTPUEmbeddingCore.call`): it has no tensor-dependent
  # Python control flow, and converting it and all it calls is slower than tracing it.
  @tf.autograph.experimental.do_not_convert
  def lookup(self, features: Any, weights: Any = None, trap: Optional[tf.Variable] = None) -> Any:
    """Activations with the structure of `features`.

    With `trap`, the activations carry a gradient function that updates the tables; without it
    they are plain (serving, evaluation, or Keras-managed tables, which are differentiable).
    Functions traced for a SavedModel get no trap when a table's learning rate is read from a
    Keras optimizer: `tf.saved_model.save` would save the trap's gradient, which reads that
    optimizer's variables, and the SavedModel does not hold the optimizer. Their tables are then
    plain differentiable variables in the SavedModel, as in tf-recommenders.
    """
    self.build()
    static = static_path.compiling()  # XLA compiles this step: decided once for both passes
    plain = (
      trap is None
      or (self._follows_keras_optimizer and tf_internals.in_save_context())
      or lookup.tracing_an_export()
    )
    if static:
      self._refuse_under_xla(training=not plain)
    step = inputs.Step.prepare(
      self._config,
      features,
      weights,
      compiled=static,
      gathered_on_cpu=frozenset() if static else self._gathered_on_cpu(),
    )
    if self._check_finite:
      step = finite.check_weights(step)
    joined = finite.Joined()  # set if PartialTPUEmbedding's joint step runs the checks
    if plain:
      how = static_path.look_up_table if static else lookup.per_occurrence
      flat = lookup.look_up(step, self.parameters, how).activations
    else:
      reusable = self._register_training_lookup(step)

      gradients_taken = [0]
      forward = []

      def look_up():
        how = static_path.look_up_table if static else lookup.for_training()
        forward.append(lookup.look_up(step, self.parameters, how))
        return forward[-1].activations

      def update(upstream):
        gradients_taken[0] += 1
        if gradients_taken[0] == 2:
          warnings.warn(SECOND_GRADIENT_WARNING, stacklevel=3)
        # Tables are trained here, never by the user's optimizer, even if they are trainable
        # variables (e.g. one passed to `update_embedding_table`).
        self._apply_gradients(
          forward[-1].upstream_by_table(upstream), reusable(), static, joined.guarded
        )

      # A SavedModel of a function traced before saving gets a plain lookup's gradient.
      flat = trap_lib.trapped(trap, look_up, update, plain_when_saved=True)
    if self._check_finite:
      flat = finite.guard_gradients(flat, step.bags, joined)
      if not plain:
        finite.join(flat, lambda upstream: self._updates.checks_of(forward[-1], upstream), joined)
    return tf.nest.pack_sequence_as(features, flat)

  def _gathered_on_cpu(self) -> frozenset:
    """Tables whose lookup in this call may leave out-of-range ids to its gather to refuse
    (`lookup.exporting`, whose lookups are plain: per occurrence, no trap)."""
    if self._distribution is not Distribution.LOCAL:
      return frozenset()
    return lookup.gathered_on_cpu({table: self.parameters(table) for table in self._config.tables})

  def _register_training_lookup(self, step: inputs.Step) -> Callable[[], frozenset]:
    """Counts this lookup; returns what tells its gradient which forward rows it may reuse.

    The update may write back rows computed from the rows the forward pass read, instead of
    reading them again, only where nothing can have written them in between: in the graph
    that looked them up, for a table looked up only once in that graph, for the first
    gradient of this lookup, off any strategy and without pipelining (whose update is
    applied a step later).
    """
    if (
      self._pipelining
      or tf.executing_eagerly()
      or self._distribution is not Distribution.LOCAL
      or tf.distribute.has_strategy()
    ):
      return lambda: frozenset()  # re-read everything
    graph = tf.compat.v1.get_default_graph()
    counts = self._training_lookups.setdefault(graph, collections.Counter())
    counts.update(table.name for table in step.tables)
    first_gradient = [True]

    def reusable() -> frozenset:
      if not first_gradient[0] or tf.compat.v1.get_default_graph() is not graph:
        return frozenset()
      first_gradient[0] = False
      return frozenset(table.name for table in step.tables if counts[table.name] == 1)

    return reusable

  def _refuse_under_xla(self, training: bool) -> None:
    """Refuses what the engine does with run-time errors or variable-length state, which an XLA
    program cannot have, rather than compiling it into a step that silently skips it."""
    if self._check_finite:
      raise ValueError(
        "check_finite=True raises an error at run time at the first non-finite value, which a "
        "step compiled by XLA cannot do: train this layer without jit_compile to check, or "
        "without check_finite."
      )
    if training and self._pipelining:
      raise ValueError(
        "pipeline_execution_with_tensor_core=True is emulated off TPU by holding each step's "
        "update in variable-length buffers, which XLA cannot compile: train this layer "
        "without jit_compile, or without pipelining (on TPU, pipelining is the hardware's)."
      )

  def flush(self) -> None:
    """Applies pipelined updates still pending, e.g. before a checkpoint or an evaluation."""
    if self._built:
      self._updates.flush()

  def parameters(self, table: TableConfig) -> tf.Variable:
    try:
      return self._variables[table.name]["parameters"]
    except KeyError:
      raise ValueError(
        f"Table {table.name!r} is not one of this layer's tables ({sorted(self._variables)})."
      ) from None

  # -------------------------------------------------------------------------------------------
  # Backward: one update per table and step, summed over every replica

  def _apply_gradients(
    self,
    per_table: Sequence[tuple[TableConfig, lookup.TableLookup, list]],
    reusable: frozenset = frozenset(),
    static: bool = False,
    checked: bool = False,
  ):
    """Updates the tables from their lookups' activation gradients. `checked`: a joint step
    ran this step's `check_finite` checks on these gradients already."""
    trainable, refusals = [], []
    for table, batch, upstream in per_table:
      if table.optimizer is None:
        refusals.append(_refuse_training(table, static))
      else:
        trainable.append((table, batch, upstream))
    # Every table's checks run before the first write of any table.
    with tf.control_dependencies(refusals):
      if static:  # fixed shapes, and an all-reduce where several replicas train
        written = self._updates
        static_path.apply_gradients(trainable, written.rule, written.state, written.learning_rate)
      elif exchange.replicas_to_sum() == 1:  # this step's gradients are the global batch's:
        # no merge, whose per-table gathers, second deduplication and sums cost a one-device
        # strategy's first step (TF Model Garden trains under one) more than the update itself
        self._updates.update_tables(
          [
            (t, batch.unique_ids, batch.row_gradients(upstream, t.dim))
            for t, batch, upstream in trainable
          ],
          {t.name: batch.looked_up_rows for t, batch, _ in trainable if t.name in reusable},
          checked,
        )
      else:  # in a replica: one update per table from every replica's (id, gradient) pairs
        # (checked again: the joint step saw only this replica's)
        exchange.gather_and_update(trainable, self._updates.update_tables)


def _refuse_training(table: TableConfig, static: bool) -> Optional[tf.Operation]:
  """Fails a training step on a table without optimizer, when the step runs.

  In a graph the check is an op rather than a Python error so that tracing gradients without
  running them (as `tf.saved_model.save` does for serving-only layers) still works; it is
  returned for the writes of the step's other tables to wait on. XLA compiles such an op to
  nothing, so a step it compiles is refused while it is traced (unless for a SavedModel).
  """
  message = (
    f"Table {table.name!r} has no optimizer, so it cannot be trained: pass optimizer= "
    "to the layer or set this TableConfig's optimizer. (optimizer=None is for "
    "serving-only layers.) This step wrote nothing to any table."
  )
  if tf.executing_eagerly() or (static and not tf_internals.in_save_context()):
    raise ValueError(message)
  return tf.debugging.Assert(tf.constant(False), [message])
