"""What every layer taking `managed_ids` adds: `managed_ids`, `remap`, the remap of a call (one
map step for all replicas: `run_once`), the resets it returns (`ReturnedResets`) and, with
`check_finite`, the undo of its map steps."""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Optional

import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding import hardware, tf_internals
from tpu_embedding.engine import finite, inputs, static_path
from tpu_embedding.managed_ids import row_resets
from tpu_embedding.managed_ids.id_map import IdMap
from tpu_embedding.managed_ids.spec import KeyRowMap
from tpu_embedding.managed_ids.tables import ManagedTables, flat_values


class ManagedIdsMixin:
  """Mixed into a layer core that sets `_managed` (None or `ManagedTables`; with maps it then
  calls `_write_rows_with`), `_config` and `_check_finite`."""

  _managed: Optional[ManagedTables]
  _config: config_lib.EmbeddingConfig
  _check_finite: bool

  def _write_rows_with(self, writer: row_resets.Writer) -> None:
    """Hands the rows the maps give to new keys to `writer`, the path's."""
    self._row_writer = writer
    self._returned = ReturnedResets()

  def _flush_rows(self, restoring: bool = False) -> None:
    """Writes every reset still waiting: those remaps returned and nobody wrote (batches remapped
    ahead of training, or left in a pipeline when its loop stopped), then the writer's.
    `restoring`: a checkpoint restore follows (`Writer.flush`)."""
    if self._managed is None:
      return
    due = self._returned.due()
    if due:  # only where remaps returned resets: each `write` counts as a remap on TPU V1
      self._row_writer.write(due)
    self._row_writer.flush(restoring)

  @property
  def managed_ids(self) -> dict[str, KeyRowMap]:
    """{table name: its key -> row map} for the tables named in `managed_ids`."""
    return {} if self._managed is None else dict(self._managed.maps)

  def remap(self, features: Any, training: bool = True, defer_resets: bool = False) -> Any:
    """`features` with the raw keys of managed tables replaced by their rows, as the layer's
    call does; with `training`, one step of each map (admission, eviction, resets of the rows
    given to new keys). Call it outside a step that XLA compiles, or on the global batch outside
    `strategy.run`, then call the layer with `remapped=True`.

    With `defer_resets`, returns `(rows, resets)` and writes no table: `resets` ({managed table
    name: rows given to new keys, padded with 0 to the number of the table's keys in the batch,
    so that its shape follows the batch's}) go to `reset_rows` right before the step that takes
    `rows`. So the remap may run ahead of training, as a `tf.data` map: a later batch's resets
    must not land on rows that an earlier batch, still training, reads and updates."""
    if self._managed is None:
      raise ValueError(f"Layer {self.name!r} has no managed_ids: its features are rows already.")
    if not defer_resets:
      return self._remap(self._config, features, bool(training))
    if in_replica_of_several():
      raise ValueError(
        f"Layer {self.name!r}: remap(..., defer_resets=True) was called inside one of several "
        "replicas; its resets travel with a whole batch. Call it on the global batch outside "
        "strategy.run (e.g. in the input pipeline), or call the layer with raw keys inside "
        "strategy.run. Nothing was changed."
      )
    self._managed.check_resets_returned(self.name)
    self._row_writer.check(self.name, deferring=True)
    given = {name: [] for name in self._managed.maps}  # AutoGraph: no annotated nonlocal
    rows = self._remap(self._config, features, bool(training), returned=given)
    keys = {name: [] for name in given}  # each table's rows in the batch, flat
    for feature, ids in config_lib.match_structure(self._config, rows, subset=True):
      if feature.table.name in keys:
        keys[feature.table.name].append(flat_values(ids))
    return rows, {name: _padded(given[name], keys[name]) for name in given}

  def reset_rows(self, resets: Mapping[str, Any]) -> None:
    """Writes the resets a `remap(..., defer_resets=True)` returned: fresh values in the rows
    it gave to new keys, each table's and its slots'. Call it after every step of earlier
    batches and before the step that takes that remap's rows."""
    if self._managed is None:
      raise ValueError(f"Layer {self.name!r} has no managed_ids: it has no resets to write.")
    if not isinstance(resets, Mapping):
      raise TypeError(
        f"reset_rows takes the dict {{table name: rows}} that remap(..., defer_resets=True) "
        f"returned, got {type(resets).__name__}."
      )
    checked, checks = {}, []
    for name, rows in resets.items():
      if name not in self._managed.maps:
        raise ValueError(
          f"reset_rows was given rows of table {name!r}, which has no managed ids in layer "
          f"{self.name!r}; its managed tables are {sorted(self._managed.maps)}. Nothing was "
          "changed."
        )
      checked[name], check = _given_rows(name, rows, self._managed.maps[name].capacity)
      checks.append(check)
    with tf.control_dependencies(checks):  # traced, too: every table checked before any write
      for name, rows in checked.items():
        rows = tf.boolean_mask(rows, tf.identity(rows) > 0)
        self._row_writer.write({name: rows})
        self._returned.written(self._config.find_table(name), rows)

  def _remap_call(
    self,
    features: Any,
    weights: Any,
    training: Any,
    remapped: bool,
    serving_config: Any = None,
  ) -> tuple[Any, Callable[[Any], Any]]:
    """The features a call looks up: remapped unless the layer has no maps or `remapped`;
    admitting keys unless `training` is False or the call serves through `serving_config`.
    A training remap waits for the checks of the whole call (`weights` included). Also what
    the call's outputs go through: with `check_finite`, a guard that undoes the map steps if
    their gradient is not finite (`StepUndo`)."""
    if self._managed is None or remapped:
      return features, _unchanged
    config = self._config
    if serving_config is not None:
      config = config_lib.for_serving(serving_config, self._config)
    admits = training is not False and serving_config is None
    step_undo = None
    if admits and self._check_finite and not tf_internals.in_save_context():
      step_undo = StepUndo(self._managed.maps, self.variables_by_table)
    rows = self._remap(config, features, admits, weights=weights, whole_call=True, undo=step_undo)
    return rows, _unchanged if step_undo is None else step_undo.guard

  def _remap(
    self,
    config: config_lib.EmbeddingConfig,
    features: Any,
    admits: bool,
    returned: Optional[dict[str, list[tf.Tensor]]] = None,
    weights: Any = None,
    whole_call: bool = False,
    undo: Optional[StepUndo] = None,
  ) -> Any:
    """`returned`: where the rows given to new keys go, per table, instead of the path's writer
    (`remap(..., defer_resets=True)`). A training remap inside one of several replicas is one
    step for all of them (`run_once`). `whole_call`: `features` must hold every feature (a
    call), not some (a `remap`). `undo`: keeps what the map steps change."""
    self._refuse_keys_in_tpu_step()
    admits = admits and not tf_internals.in_save_context()  # serving traces never admit keys
    managed = self._managed.keys_of(config, features)
    keys = managed.keys
    if admits:  # every check of the call passes before any map changes
      checks = self._checks_before_step(config, features, weights, not whole_call)
      with tf.control_dependencies(checks):
        keys = [tf.identity(k) for k in keys]  # carries the checks into a merge_call too

    def step(keys: list[tf.Tensor]) -> list[tf.Tensor]:
      if admits:
        self._row_writer.check(self.name, deferring=returned is not None)
      rows, given = self._managed.step(managed.tables, keys, admits, self._row_writer)
      if admits:
        self._hand_over(given, returned, undo)
      return rows

    rows = managed.with_rows(run_once(step, keys) if admits else step(keys))
    if undo is not None:
      undo.stepped()
    if admits and returned is None:  # rows this call trains: resets left by dropped batches first
      for feature, ids in config_lib.match_structure(config, rows, subset=True):
        if feature.table.name in self._managed.maps:
          due = self._returned.due_before_training(feature.table, flat_values(ids))
          if due is not None:
            self._row_writer.write({feature.table.name: due})
    return row_resets.hide_waiting(self._row_writer.waiting, config, rows)

  def _hand_over(
    self,
    given: dict[str, tf.Tensor],
    returned: Optional[dict[str, list[tf.Tensor]]],
    undo: Optional[StepUndo],
  ) -> None:
    """The rows one training remap gave to new keys: to the caller (`returned`, and counted), or
    to the path's writer (what they held kept first for `undo`)."""
    if returned is not None:
      for name, rows in given.items():
        self._returned.given(self._config.find_table(name), rows)
        returned[name].append(rows)
      return
    if undo is not None:
      undo.keep(given)
    self._row_writer.write(given)

  def _checks_before_step(
    self, config: config_lib.EmbeddingConfig, features: Any, weights: Any, subset: bool
  ) -> list[tf.Tensor]:
    """Runs every check of the ids, weights and shapes the lookup will make, on the features
    with the managed keys read as row 0, so that a call they refuse changes no map: eagerly it
    raises here; traced, the ops it returns gate the map's step. `subset`: a `remap` of some
    features of the global batch, ahead of the step (so not held to the per-replica
    `output_shape`)."""
    placeholders = self._managed.with_row_zero(config, features, subset)
    step = inputs.Step.prepare(config, placeholders, weights, subset=subset, global_batch=subset)
    if self._check_finite:  # the weights' check too: it comes before the gradient's verdict
      step = finite.check_weights(step)
    return [t for bag in step.bags for t in (bag.ids, bag.gains) if t is not None]

  def _refuse_keys_in_tpu_step(self) -> None:
    """A map steps once per global batch, on the host. A TPU step is traced once for all its
    replicas, whose host work (outside compilation) then runs apart, each on its own keys: no
    host code inside it sees the global batch (a `merge_call` gets one replica's keys), and
    TF's V1 enqueue there takes only the step's own inputs. So keys are remapped before it."""
    if static_path.compiling() and not hardware.is_tpu_strategy(tf.distribute.get_strategy()):
      raise ValueError(
        f"Layer {self.name!r} has managed_ids and was given raw keys in a step that XLA "
        "compiles (jit_compile=True), where its key -> row maps (hash tables) cannot run. Remap "
        "outside the compiled function: rows = layer.remap(features), then layer(rows, "
        "remapped=True) inside it. Nothing was changed."
      )
    if tf.distribute.in_cross_replica_context():
      return
    if hardware.is_tpu_strategy(tf.distribute.get_strategy()):
      raise ValueError(
        f"Layer {self.name!r} has managed_ids and was given raw keys inside a TPU step. Its "
        "key -> row maps take one step per global batch on the host, and inside a TPU step "
        "each replica's host work runs apart on its own keys. Remap the global batch on the "
        "host before the step: rows = layer.remap(features) outside strategy.run, then "
        "layer(rows, remapped=True) inside it. Nothing was changed."
      )


class ReturnedResets:
  """Resets that remaps returned (`remap(..., defer_resets=True)`), per table: how many times
  they gave each row, and how many of those resets were written. Each count has one writer (the
  remaps' thread, the training loop), so neither races the other."""

  def __init__(self):
    self._counts: dict[str, tuple[tf.Variable, tf.Variable]] = {}

  def given(self, table: config_lib.TableConfig, rows: tf.Tensor) -> None:
    """A remap returned `rows` of `table` unwritten."""
    given, _ = self._of(table)
    given.scatter_add(tf.IndexedSlices(tf.ones_like(rows, tf.int32), rows))

  def written(self, table: config_lib.TableConfig, rows: tf.Tensor) -> None:
    """The caller wrote `rows` (`reset_rows`); one written late, after `due` or
    `due_before_training` took it, was written again but counts once."""
    given, written = self._of(table)
    done = tf.minimum(tf.gather(written, rows) + 1, tf.gather(given, rows))
    written.scatter_update(tf.IndexedSlices(done, rows))

  def due_before_training(
    self, table: config_lib.TableConfig, rows: tf.Tensor
  ) -> Optional[tf.Tensor]:
    """Of `rows`, which a call with raw keys is about to train, those a remap returned and
    nobody wrote (its batch was dropped), counted as written: they are written now, once,
    before their keys train the rows, never after. None where no remap returned any."""
    if table.name not in self._counts:
      return None
    given, written = self._of(table)
    rows = tf.unique(tf.cast(rows, tf.int64))[0]
    due = tf.boolean_mask(rows, tf.gather(given, rows) > tf.gather(written, rows))
    written.scatter_update(tf.IndexedSlices(tf.gather(given, due), due))
    return due

  def due(self) -> dict[str, tf.Tensor]:
    """{table name: rows returned and not written}, counted as written (each is due once, so
    later flushes leave the row, trained since, alone; `reset_rows` still writes it when it
    comes, before its batch's step)."""
    due = {}
    for name, (given, written) in self._counts.items():
      due[name] = tf.where(given > written)[:, 0]
      written.assign(given)
    return due

  def _of(self, table: config_lib.TableConfig) -> tuple[tf.Variable, tf.Variable]:
    if table.name not in self._counts:
      with tf.init_scope():  # made once, eagerly, also when first asked inside a trace
        self._counts[table.name] = tuple(
          tf.Variable(tf.zeros([table.vocabulary_size], tf.int32), trainable=False, name=name)
          for name in ("resets_returned", "resets_written")
        )
    return self._counts[table.name]


def _unchanged(outputs: Any) -> Any:
  return outputs


def _padded(given: list[tf.Tensor], keys: list[tf.Tensor]) -> tf.Tensor:
  """The rows `given` to new keys, then 0 (never given) up to as many as `keys`: a shape that
  changes only with the batch's, so a `tf.function` taking it does not trace at every step."""
  rows = tf.concat(given, 0) if given else tf.zeros([0], tf.int64)
  total = sum(tf.size(k, out_type=tf.int64) for k in keys) if keys else tf.constant(0, tf.int64)
  padded = tf.pad(rows, [[0, total - tf.size(rows, out_type=tf.int64)]])
  static = [k.shape.num_elements() for k in keys]
  if None not in static:
    padded.set_shape([sum(static)])
  return padded


def _given_rows(name: str, rows: Any, capacity: int) -> tuple[tf.Tensor, Any]:
  """(`rows` as an int64 vector, the op checking them all in 0 .. capacity - 1, 0 being
  padding), or an error naming the table."""
  try:
    rows = tf.convert_to_tensor(rows)
  except (TypeError, ValueError) as error:
    raise TypeError(f"reset_rows: the rows of table {name!r} are not a tensor: {error}") from None
  if not rows.dtype.is_integer or rows.shape.rank != 1:
    raise TypeError(
      f"reset_rows: the rows of table {name!r} must be a vector of integer rows, as "
      f"remap(..., defer_resets=True) returns them; got {rows.dtype.name} of shape {rows.shape}."
    )
  rows = tf.cast(rows, tf.int64)
  check = tf.debugging.assert_equal(
    tf.reduce_all((rows >= 0) & (rows < capacity)),
    True,
    message=f"reset_rows: table {name!r} gives rows 1 .. {capacity - 1} to new keys (0: none); "
    "a row outside them was given",
  )
  return rows, check


# ---------------------------------------------------------------------------------------------
# With `check_finite`, a step refused for a non-finite gradient leaves every map as it was.
#
# The map's step runs in the forward pass (its rows are what the lookup reads), but the verdict on
# the step's gradients comes in the backward pass. So a layer with `check_finite` keeps, for the
# call's map steps, what they changed: each map's variables and candidates before the step, and
# the values the resets overwrote in the rows given to new keys. The gradient of the call's
# outputs, before it reaches any table, puts them back if it holds a NaN or Inf: the check that
# follows refuses the step, and the map, the given rows and their slots are as before the call.
#
# What is undone: the steps refused for their activations' gradients (the check every step
# makes first). A step refused later, for a learning rate or an update that overflows, keeps its
# map step (docs/reliability.md). A map step that a later call built on is never undone.


class StepUndo:
  """What one call's map steps changed, to put back if the call's gradient is not finite."""

  def __init__(
    self, maps: Mapping[str, Any], variables_by_table: Mapping[str, Mapping[str, tf.Variable]]
  ):
    """`variables_by_table`: the layer's tables ({table name: {"parameters"/slot: variable}})."""
    # Maps split over parameter servers (no `check_finite` there) are not undone.
    self._maps = {name: m for name, m in maps.items() if isinstance(m, IdMap)}
    self._variables_by_table = variables_by_table
    self._before = {name: _state(m) for name, m in self._maps.items()}
    self._rows: list[tuple[str, tf.Tensor, dict[str, tf.Tensor]]] = []
    self._after: dict[str, tf.Tensor] = {}

  def keep(self, given: Mapping[str, tf.Tensor]) -> None:
    """Keeps what the rows `given` to new keys ({table name: rows}) hold, before their reset."""
    for name, rows in given.items():
      variables = self._variables_by_table.get(name)
      if variables is not None and name in self._maps:
        self._rows.append((name, rows, {k: tf.gather(v, rows) for k, v in variables.items()}))

  def stepped(self) -> None:
    """The call's map steps are done: an undo applies only while no later step built on them."""
    self._after = {name: m.step.read_value() for name, m in self._maps.items()}

  def guard(self, outputs: Any) -> Any:
    """`outputs`, whose gradient, if it holds a non-finite value, first undoes the steps."""
    flat = tf.nest.flatten(outputs)

    @tf.custom_gradient
    def guarded(*activations):
      def grad(*upstream):
        given = [g for g in upstream if g is not None]
        if not given:
          return list(upstream)
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in given])
        undone = tf.cond(finite, lambda: tf.constant(False), self._undo)
        with tf.control_dependencies([undone]):
          return [g if g is None else tf.identity(g) for g in upstream]

      return [tf.identity(a) for a in activations], grad

    return tf.nest.pack_sequence_as(outputs, guarded(*flat))

  def _undo(self) -> tf.Tensor:
    for name, id_map in self._maps.items():
      unchanged = tf.equal(id_map.step.read_value(), self._after[name])
      tf.cond(unchanged, lambda m=id_map, s=self._before[name]: _restore(m, s), _nothing)
    for name, rows, values in reversed(self._rows):  # the oldest write restored last
      variables = self._variables_by_table[name]
      for key, value in values.items():
        variables[key].scatter_update(tf.IndexedSlices(value, rows))
    return tf.constant(True)


def _state(id_map: IdMap) -> dict[str, tf.Tensor]:
  """Copies of the map's variables (and candidates), as they are before its step."""
  state = {v.name: tf.identity(v.read_value()) for v in _variables(id_map)}
  if id_map.candidates is not None:
    state["candidates"] = id_map.candidates.export()
  return state


def _restore(id_map: IdMap, state: Mapping[str, Any]) -> tf.Tensor:
  for variable in _variables(id_map):
    variable.assign(state[variable.name])
  id_map.reindex()  # the hash tables follow the variables (candidates emptied: refilled next)
  if id_map.candidates is not None:
    id_map.candidates.insert(*state["candidates"])
  return tf.constant(True)


def _variables(id_map: IdMap) -> list[tf.Variable]:
  return [id_map.keys, id_map.counts, id_map.last_seen, id_map.step]


def _nothing() -> tf.Tensor:
  return tf.constant(True)


# ---------------------------------------------------------------------------------------------
# One step of each managed map per training step, however many replicas share the batch.
#
# Inside `strategy.run` with several replicas each replica holds a share of the global batch, but
# a map must take each step's keys once, in one order, or the replicas would see different maps.
# So the replicas' keys meet in one `merge_call` (as an optimizer's updates are applied once),
# ordered as one device fed the global batch reads them: each managed feature in the layer's
# order, its replicas' shares in replica order (a replica's share of a feature is its rows of the
# global batch). The step runs once there, in the cross-replica context, and each replica gets the
# rows of its own keys back. Under `MultiWorkerMirroredStrategy` the keys are all-gathered from
# every worker and each worker runs the same deterministic step on its own copy of the map, so
# the copies stay equal without sending rows or map state between workers.

# The rows of the global batch's keys (one flat tensor per managed feature) by one map step.
Step = Callable[[list[tf.Tensor]], list[tf.Tensor]]


def in_replica_of_several() -> bool:
  """Whether this code runs inside one of several replicas of `strategy.run`."""
  if tf.distribute.in_cross_replica_context():
    return False
  return tf.distribute.get_replica_context().num_replicas_in_sync > 1


def run_once(step: Step, keys: list[tf.Tensor]) -> list[tf.Tensor]:
  """`step` on the global batch's keys, once: directly where this call holds the whole batch,
  else once for all replicas (this replica's rows returned)."""
  if not in_replica_of_several():
    return step(keys)
  sizes = tf.stack([tf.size(k, out_type=tf.int64) for k in keys])
  context = tf.distribute.get_replica_context()
  return context.merge_call(functools.partial(_step_once, step=step), args=(keys, sizes))


def _step_once(strategy: tf.distribute.Strategy, keys: list[Any], sizes: Any, step: Step) -> Any:
  """In the cross-replica context: the global keys through `step`, each replica's rows cut out."""
  replicas = strategy.num_replicas_in_sync
  shares = tf.reshape(_gathered(strategy, sizes), [replicas, len(keys)])
  rows = step([_gathered(strategy, k) for k in keys])
  pieces = [tf.split(r, shares[:, f], num=replicas) for f, r in enumerate(rows)]
  return strategy.experimental_distribute_values_from_function(
    lambda context: [p[context.replica_id_in_sync_group] for p in pieces]
  )


def _gathered(strategy: tf.distribute.Strategy, value: Any) -> tf.Tensor:
  """Every replica's `value`, concatenated in replica order: the replicas of this process joined
  here, other workers' by the strategy's all-gather (numbers only: a string-key map's keys
  arrive as their int64 fingerprints)."""
  local = strategy.experimental_local_results(value)
  if len(local) == strategy.num_replicas_in_sync:
    return tf.concat(local, 0)
  return strategy.gather(value, axis=0)
