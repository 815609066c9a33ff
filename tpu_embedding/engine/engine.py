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
import functools
import math
import warnings
import weakref
from typing import Any, Callable, Optional, Sequence

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops  # uninitialised variables
from tensorflow.python.saved_model import save_context  # whether a SavedModel is being traced

from tpu_embedding import checkpoints
from tpu_embedding import config as config_lib
from tpu_embedding import optimizers
from tpu_embedding.engine import finite
from tpu_embedding.engine import lookup
from tpu_embedding.engine import sharded
from tpu_embedding.engine import static_path
from tpu_embedding.engine.updates import apply_sparse_update

TableConfig = tf.tpu.experimental.embedding.TableConfig

SECOND_GRADIENT_WARNING = (
  "tpu_embedding: the activations of one TPUEmbedding call received a second gradient (e.g. "
  "a persistent GradientTape asked twice); each gradient that reaches the activations "
  "updates the tables, so this step updated them again. Take one tape.gradient per step "
  "with respect to all trainable variables (see the README: the gradient trap's contract)."
)


class EmbeddingEngine(tf.Module):
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
  _TF_MODULE_IGNORED_PROPERTIES = frozenset({"_pending", "_training_lookups"}).union(
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
    self._keras_managed = table_updates == "keras"
    self._check_finite = check_finite
    self._follows_keras_optimizer = any(
      optimizers.follows_keras_optimizer(table.optimizer) for table in config.tables
    )
    self._variables: dict[str, dict[str, tf.Variable]] = self._no_dependency({})
    self._pending: dict[str, dict[str, tf.Variable]] = self._no_dependency({})
    # Tables row-sharded over parameter servers: the locks their updates hold.
    self._shard_locks: dict[str, sharded.ShardLocks] = self._no_dependency({})
    # Per graph being traced: how many training lookups read each table (see
    # `_register_training_lookup`).
    self._training_lookups = self._no_dependency(weakref.WeakKeyDictionary())
    self._built = False
    self._strategy = tf.distribute.get_strategy()  # tables are created under it, as TF does

  # -------------------------------------------------------------------------------------------
  # Variables

  @property
  def built(self) -> bool:
    return self._built

  def build(self) -> None:
    """Creates every table (and its slots) once, outside any function being traced."""
    if self._built:
      return
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
    shape = [table.vocabulary_size, table.dim]
    initializer = table.initializer or tf.initializers.TruncatedNormal(
      mean=0.0, stddev=1.0 / (table.dim**0.5)
    )
    parameters = _new_variable(initializer, shape, table.name, self._keras_managed)
    variables = {"parameters": parameters}
    self._track_trackable(parameters, name=table.name)
    if table.optimizer is not None and not self._keras_managed:
      variables.update(self._create_slots(table, parameters))
      if sharded.is_sharded(parameters) and self._pipelining:
        sharded.refuse_pipelining(table)
      on_parameter_servers = isinstance(
        tf.distribute.get_strategy(), tf.distribute.ParameterServerStrategy
      )
      if on_parameter_servers and not self._pipelining:
        self._shard_locks[table.name] = sharded.ShardLocks(parameters)
    self._variables[table.name] = variables
    if self._pipelining and not self._keras_managed:
      self._pending[table.name] = _pending_buffers(table)

  def _create_slots(self, table: TableConfig, parameters: tf.Variable) -> dict[str, tf.Variable]:
    optimizer = table.optimizer
    names = optimizer._slot_names()  # pylint: disable=protected-access
    initializers = optimizer._slot_initializers()  # pylint: disable=protected-access
    creator = getattr(optimizer, "slot_variable_creation_fn", None)
    if creator is not None:
      return dict(creator(parameters, names, initializers))
    if sharded.is_sharded(parameters):
      slots = sharded.create_slots(table, parameters, names, initializers)
    else:
      with sharded.colocated_with(parameters):
        slots = {
          name: _new_variable(initializer, shape, f"{table.name}/{name}", False)
          for (name, shape), initializer in zip(config_lib.slot_shapes(table), initializers)
        }
    for name, slot in slots.items():
      self._track_trackable(slot, name=f"{table.name}/{name}")
    return slots

  def _checkpoint_adapter(self, path: str):
    # TF's per-object restore hook, called before any table or slot of this engine is bound:
    # refuse the whole restore here if any of them is missing or has another shape.
    checkpoints.validate(self, self._config, not self._keras_managed, path)
    return super()._checkpoint_adapter(path)

  @property
  def variables_by_table(self) -> dict[str, dict[str, tf.Variable]]:
    """{table name: {"parameters": table, slot name: slot}}, as the mid-level `variables`."""
    self.build()
    return self._variables

  def replace_table(self, table: TableConfig, variable: tf.Variable) -> None:
    """Makes `variable` the table for lookups, updates and checkpoints alike."""
    self.build()
    self.flush()  # updates held back belong to the variable being replaced
    self._variables[table.name]["parameters"] = variable
    self._track_trackable(variable, name=table.name, overwrite=True)

  @property
  def embedding_tables(self) -> dict[TableConfig, tf.Variable]:
    self.build()
    return {t: self._variables[t.name]["parameters"] for t in self._config.tables}

  # -------------------------------------------------------------------------------------------
  # Lookup

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
    step = lookup.Step.prepare(self._config, features, weights, check_ranges=not static)
    if self._check_finite:
      finite.check_weights(step)
    if trap is None or (self._follows_keras_optimizer and save_context.in_save_context()):
      flat = (
        static_path.activations(step, self.parameters)
        if static
        else step.activations(self.parameters)
      )
    else:
      reusable = self._register_training_lookup(step)
      if static:
        self._refuse_pipelining_under_xla()

      gradients_taken = [0]

      @tf.custom_gradient
      def gradient_trap(dummy):
        def grad(*upstream, variables=None):
          # tf.saved_model.save traces this function once more to save it: not a second
          # gradient of the step.
          if not save_context.in_save_context():
            gradients_taken[0] += 1
            if gradients_taken[0] == 2:
              warnings.warn(SECOND_GRADIENT_WARNING, stacklevel=2)
          # Tables are trained here, never by the user's optimizer, even if they are trainable
          # variables (e.g. one passed to `update_embedding_table`).
          self._apply_gradients(step.upstream_by_table(upstream), reusable(), static)
          return tf.zeros_like(dummy), [None] * len(variables or ())

        if static:
          return static_path.activations(step, self.parameters), grad
        return step.activations(self.parameters, deduplicate=True), grad

      flat = gradient_trap(trap)
    if self._check_finite:
      flat = finite.guard_gradients(flat, step.bags)
    return tf.nest.pack_sequence_as(features, flat)

  def _register_training_lookup(self, step: lookup.Step) -> Callable[[], frozenset]:
    """Counts this lookup; returns what tells its gradient which forward rows it may reuse.

    The update may write back rows computed from the rows the forward pass read, instead of
    reading them again, only where nothing can have written them in between: in the graph
    that looked them up, for a table looked up only once in that graph, for the first
    gradient of this lookup, off any strategy and without pipelining (whose update is
    applied a step later).
    """
    if self._pipelining or tf.executing_eagerly() or tf.distribute.has_strategy():
      return lambda: frozenset()  # re-read everything
    graph = tf.compat.v1.get_default_graph()
    counts = self._training_lookups.setdefault(graph, collections.Counter())
    counts.update(table.name for table in step.batches)
    first_gradient = [True]

    def reusable() -> frozenset:
      if not first_gradient[0] or tf.compat.v1.get_default_graph() is not graph:
        return frozenset()
      first_gradient[0] = False
      return frozenset(table.name for table in step.batches if counts[table.name] == 1)

    return reusable

  def _refuse_pipelining_under_xla(self) -> None:
    if self._pipelining:
      raise ValueError(
        "pipeline_execution_with_tensor_core=True is emulated off TPU by holding each step's "
        "update in variable-length buffers, which XLA cannot compile: train this layer "
        "without jit_compile, or without pipelining (on TPU, pipelining is the hardware's)."
      )

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
    per_table: Sequence[tuple[TableConfig, lookup.TableBatch, list]],
    reusable: frozenset = frozenset(),
    static: bool = False,
  ):
    trainable = []
    for table, batch, upstream in per_table:
      if table.optimizer is None:
        _refuse_training(table)
      else:
        trainable.append((table, batch, upstream))
    if static:  # fixed shapes, and an all-reduce where several replicas train
      static_path.apply_gradients(trainable, self._state)
      return
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
      for table, batch, upstream in trainable:
        rows = batch.looked_up_rows if table.name in reusable else None
        self._update(table, batch.unique_ids, batch.row_gradients(upstream, table.dim), rows)
      return
    # In a replica: hand every occurrence's (id, gradient) to one cross-replica update, so the
    # tables get the sum over the global batch, in the same order as on a single device.
    strategy = tf.distribute.get_strategy()
    context = tf.distribute.get_replica_context()
    bags, sizes = [], []
    for table, batch, upstream in trainable:
      bag_sizes = [tf.size(b.ids) for b in batch.bags]
      split = functools.partial(
        tf.split, num_or_size_splits=tf.stack(bag_sizes), num=len(bag_sizes)
      )
      grads = batch.occurrence_gradients(upstream, table.dim)
      bags.append(list(zip(split(batch.occurrence_ids), split(grads))))
      sizes.extend(bag_sizes)
    sizes = tf.stack(sizes)[None]  # [1, bags]: gathered into [replicas, bags]
    multi_worker = len(strategy.extended.worker_devices) < strategy.num_replicas_in_sync
    if multi_worker:
      # Replicas on other workers can only be reached by a collective gather, which needs equal
      # shapes: pad each bag to the largest size any replica has; the merge drops the padding.
      largest = tf.reduce_max(context.all_gather(sizes, axis=0), axis=0)
      flat = [pair for table_bags in bags for pair in table_bags]
      padded = iter(
        [(_pad_rows(i, largest[n]), _pad_rows(g, largest[n])) for n, (i, g) in enumerate(flat)]
      )
      bags = [[next(padded) for _ in table_bags] for table_bags in bags]
    context.merge_call(
      functools.partial(self._merge_and_update, [t for t, _, _ in trainable], multi_worker),
      args=(bags, sizes),
    )

  def _merge_and_update(self, tables, multi_worker, strategy, bags, sizes) -> None:
    if multi_worker:
      all_sizes = strategy.gather(sizes, axis=0)  # [replicas, bags]

    def gather(value, bag_index):
      if not multi_worker:  # every replica is on this worker: concatenate, no communication
        return tf.concat(strategy.experimental_local_results(value), axis=0)
      replica_sizes = all_sizes[:, bag_index]
      gathered = strategy.gather(value, axis=0)
      width = tf.shape(gathered)[0] // tf.size(replica_sizes)
      return tf.boolean_mask(
        gathered, tf.reshape(tf.range(width)[None, :] < replica_sizes[:, None], [-1])
      )

    position = 0
    for table, table_bags in zip(tables, bags):
      ids, grads = [], []
      for bag_ids, bag_grads in table_bags:
        ids.append(gather(bag_ids, position))
        grads.append(gather(bag_grads, position))
        position += 1
      unique_ids, index = tf.unique(tf.concat(ids, 0), out_idx=tf.int64)
      row_grads = lookup.sum_by_index(tf.concat(grads, 0), index, tf.size(unique_ids))
      self._update(table, unique_ids, row_grads)

  def _update(
    self,
    table: TableConfig,
    ids: tf.Tensor,
    grads: tf.Tensor,
    table_rows: Optional[tf.Tensor] = None,
  ) -> None:
    learning_rate = optimizers.learning_rate_tensor(table.optimizer, where=f"Table {table.name!r}")
    if self._check_finite:
      learning_rate = finite.check_learning_rate(learning_rate, table.name)
    names, state = self._state(table)
    if table.name in self._shard_locks:
      self._shard_locks[table.name].apply(table.optimizer, state, names, ids, grads, learning_rate)
      return
    # Parameter-server workers update the shared tables concurrently.
    atomic = isinstance(tf.distribute.get_strategy(), tf.distribute.ParameterServerStrategy)
    apply = _row_applier(table.optimizer, names, atomic)
    if not self._pipelining:
      _on_each_copy(state, lambda *copy: apply(copy, ids, grads, learning_rate, table_rows))
      return

    def apply_pending_then_store(*copy):
      """Pipelining: this step's update waits until after the next step's lookup (SPEC §6)."""
      has, pending_ids, pending_grads, pending_lr = copy[-4:]
      _apply_pending(apply, copy[:-4], has, pending_ids, pending_grads, pending_lr)
      pending_ids.assign(ids)
      pending_grads.assign(grads)
      pending_lr.assign(learning_rate)
      has.assign(True)

    _on_each_copy(state + self._pending_state(table), apply_pending_then_store)

  def flush(self) -> None:
    """Applies pipelined updates still pending, e.g. before a checkpoint or an evaluation."""
    if not self._pipelining or not self._built:
      return
    for table in self._config.tables:
      if table.optimizer is None:
        continue
      names, state = self._state(table)
      apply = _row_applier(table.optimizer, names)
      _on_each_copy(
        state + self._pending_state(table),
        lambda *copy: _apply_pending(apply, copy[:-4], *copy[-4:]),
      )

  def _state(self, table: TableConfig) -> tuple[list[str], list[tf.Variable]]:
    """Slot names, and the table followed by its slots in that order."""
    variables = self._variables[table.name]
    names = [n for n in variables if n != "parameters"]
    return names, [variables["parameters"]] + [variables[n] for n in names]

  def _pending_state(self, table: TableConfig) -> list[tf.Variable]:
    pending = self._pending[table.name]
    return [pending["has"], pending["ids"], pending["grads"], pending["learning_rate"]]


_COPY_IS_CHEAP_BYTES = 16 << 20


def _new_variable(
  initializer: Callable, shape: list[int], name: str, trainable: bool
) -> tf.Variable:
  """A variable holding `initializer(shape)`, without a second copy of it in memory.

  `tf.Variable(initial_value=...)` keeps the initial tensor alive while copying it into the
  variable, so a 1.3 GB table briefly costs 2.6 GB (more with the initializer's temporaries).
  Off any strategy the value is instead computed and assigned inside one function, where it is
  an intermediate that TF writes straight into the variable's buffer. Strategies create their
  own (e.g. mirrored) variables, so there the plain constructor is used, as it is for tables
  below `_COPY_IS_CHEAP_BYTES`, where the function's tracing would cost more time (at the first
  step, once per table and slot) than the copy costs memory.
  """
  value = functools.partial(_initial_value, initializer, shape, name)
  if tf.distribute.has_strategy() or 4 * math.prod(shape) < _COPY_IS_CHEAP_BYTES:
    return tf.Variable(initial_value=value, trainable=trainable, name=name)
  variable = resource_variable_ops.UninitializedVariable(
    shape=shape, dtype=tf.float32, trainable=trainable, name=name
  )
  # One function per variable (in one function for all, TF holds every constant initial value
  # at once). A partial, not a lambda: TF counts traces per code object and would warn that a
  # function meant to run once per variable is "retracing".
  tf.function(functools.partial(_assign, variable, value), autograph=False)()
  return variable


def _initial_value(initializer: Callable, shape: list[int], name: str) -> tf.Tensor:
  """`initializer(shape)`, refused by name unless it is a float32 tensor of that shape."""
  try:
    value = tf.convert_to_tensor(initializer(shape=shape, dtype=tf.float32))
  except (TypeError, ValueError) as e:
    raise ValueError(
      f"Embedding variable {name!r}: its initializer failed for shape {shape}, float32: {e}"
    ) from e
  if value.dtype != tf.float32 or value.shape != shape:
    raise ValueError(
      f"Embedding variable {name!r}: its initializer gave a {value.dtype.name} "
      f"tensor of shape {value.shape.as_list()}; expected float32 {shape}."
    )
  return value


def _assign(variable: tf.Variable, value: Callable[[], tf.Tensor]) -> None:
  variable.assign(value(), read_value=False)


def _pending_buffers(table: TableConfig) -> dict[str, tf.Variable]:
  """Variable-length buffers holding one step's update until the next step has looked up."""
  return {
    "has": tf.Variable(False, trainable=False, name=f"{table.name}/pending_has"),
    "ids": tf.Variable(
      tf.zeros([0], tf.int64),
      shape=tf.TensorShape([None]),
      trainable=False,
      name=f"{table.name}/pending_ids",
    ),
    "grads": tf.Variable(
      tf.zeros([0, table.dim]),
      shape=tf.TensorShape([None, table.dim]),
      trainable=False,
      name=f"{table.name}/pending_grads",
    ),
    "learning_rate": tf.Variable(0.0, trainable=False, name=f"{table.name}/pending_lr"),
  }


def _pad_rows(x: tf.Tensor, size: tf.Tensor) -> tf.Tensor:
  padding = [[0, size - tf.shape(x)[0]]] + [[0, 0]] * (x.shape.rank - 1)
  return tf.pad(x, padding)


def _refuse_training(table: TableConfig) -> None:
  """Fails a training step on a table without optimizer, when the step runs.

  The check is an op rather than a Python error so that tracing gradients without running them
  (as `tf.saved_model.save` does for serving-only layers) still works.
  """
  message = (
    f"Table {table.name!r} has no optimizer, so it cannot be trained: pass optimizer= "
    "to the layer or set this TableConfig's optimizer. (optimizer=None is for "
    "serving-only layers.)"
  )
  if tf.executing_eagerly():
    raise ValueError(message)
  tf.debugging.Assert(tf.constant(False), [message])


def _row_applier(optimizer, slot_names: Sequence[str], atomic: bool = False) -> Callable:
  """`apply(state, ids, grads, lr[, table_rows])` for one copy of a table's state (table, then
  slots); `table_rows` are the table's rows at `ids` when the lookup has just read them;
  `atomic` when other workers update the same variables concurrently."""

  def apply(state, ids, grads, learning_rate, table_rows=None) -> None:
    apply_sparse_update(
      optimizer,
      state[0],
      dict(zip(slot_names, state[1:])),
      ids,
      grads,
      learning_rate,
      table_rows,
      atomic=atomic,
    )

  return apply


def _apply_pending(apply: Callable, state, has, ids, grads, learning_rate) -> None:
  def run():
    apply(state, ids.read_value(), grads.read_value(), learning_rate.read_value())
    return tf.constant(True)

  tf.cond(has.read_value(), run, lambda: tf.constant(False))
  has.assign(False)


def _on_each_copy(variables: Sequence[tf.Variable], fn: Callable) -> None:
  """Calls `fn(*copies)` once per device holding the variables (once if not distributed).

  Every copy of a mirrored variable receives the same update from the same global gradient,
  which keeps the copies identical without any table-sized communication.
  """
  copies = [
    list(v.values) if isinstance(v, tf.distribute.DistributedValues) else [v] for v in variables
  ]
  for per_device in zip(*copies):
    with tf.device(per_device[0].device):
      fn(*per_device)
