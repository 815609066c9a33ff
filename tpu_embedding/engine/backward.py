"""The engine's backward pass: each table's update from its rows' gradients, once per step.

`TableUpdates` owns what an update needs besides the variables: each table's update rule,
the update held back a step under pipelining (SPEC §6), the locks of tables row-sharded over
parameter servers, and the `check_finite` checks that run before the first write of any table.
The engine decides where the gradients come from (its trap, one replica or all of them);
this module writes them.
"""

from __future__ import annotations

import functools
from typing import Iterator, Optional, Sequence

import tensorflow as tf

from tpu_embedding import optimizer_specs
from tpu_embedding.engine import exchange, finite, lookup, sharded, updates
from tpu_embedding.engine.distribution import Distribution
from tpu_embedding.engine.state import PendingUpdate, TableState

TableConfig = tf.tpu.experimental.embedding.TableConfig


class TableUpdates:
  """The updates of the tables an engine trains.

  Args:
    variables: the engine's {table name: {"parameters": table, slot: variable}}, read at each
      update (a table replaced later is the one updated).
    pipelining, check_finite: the engine's settings (see `EmbeddingEngine`).
    distribution: where the engine runs, which decides how concurrent updates are written.
  """

  def __init__(
    self,
    variables: dict[str, dict[str, tf.Variable]],
    pipelining: bool,
    check_finite: bool,
    distribution: Distribution,
  ):
    self._variables = variables
    self._pipelining = pipelining
    self._check_finite = check_finite
    self._distribution = distribution
    self._tables: list[TableConfig] = []
    self._rules: dict[str, updates.UpdateRule] = {}
    self._pending: dict[str, PendingUpdate] = {}
    self._shard_locks: dict[str, sharded.ShardLocks] = {}

  def add(self, table: TableConfig) -> None:
    """Trains `table` (its variables created already), with its optimizer's update rule."""
    parameters = self._variables[table.name]["parameters"]
    self._tables.append(table)
    self._rules[table.name] = updates.rule_for(table.optimizer)
    if sharded.is_sharded(parameters) and self._pipelining:
      sharded.refuse_pipelining(table)
    if self._distribution is Distribution.PARAMETER_SERVERS and not self._pipelining:
      self._shard_locks[table.name] = sharded.ShardLocks(parameters)
    if self._pipelining:
      self._pending[table.name] = PendingUpdate.create(table)

  def update_tables(
    self,
    per_table: Sequence[tuple[TableConfig, tf.Tensor, tf.Tensor]],
    read_rows: Optional[dict[str, tf.Tensor]] = None,
    checked: bool = False,
  ) -> None:
    """One step's update of every table, from (table, unique ids, row gradients) each.

    `read_rows` holds, by table name, the rows the lookup read where the update may reuse them.
    With `check_finite`, every table's update is checked (`finite.check_update`) before the
    first write of any table, so a step that fails writes nothing; unless `checked` (a joint
    step checked them before any engine's gradient).
    """
    read_rows = read_rows or {}
    rates = self.learning_rates([table for table, _, _ in per_table], checked)
    checks = []
    if self._check_finite and not checked:
      for (table, ids, grads), rate in zip(per_table, rates):
        checks.extend(self._check_update(table, ids, grads, rate, read_rows.get(table.name)))
    with tf.control_dependencies(checks):
      for (table, ids, grads), rate in zip(per_table, rates):
        self._update(table, ids, grads, rate, read_rows.get(table.name))

  def checks_of(self, found: lookup.StepLookup, upstream: list) -> list[tf.Tensor]:
    """The checks that this step's update (`update_tables`) would run from these gradients of
    its activations, without the update: for a layer whose other engines must not write
    either when one of these fails (`finite.JointStep`). Each feature's gradient is checked
    first, so that the error names the feature, as the update's own checks do."""
    upstream = [finite.checked_activation_gradient(g, bag) for g, bag in zip(upstream, found.bags)]
    return [
      check
      for table, batch, grads in found.upstream_by_table(upstream)
      if table.optimizer is not None
      for check in self._check_update(
        table, batch.unique_ids, batch.row_gradients(grads, table.dim), self.learning_rate(table)
      )
    ]

  def _check_update(
    self,
    table: TableConfig,
    ids: Optional[tf.Tensor] = None,
    grads: Optional[tf.Tensor] = None,
    learning_rate: Optional[tf.Tensor] = None,
    table_rows: Optional[tf.Tensor] = None,
  ) -> list[tf.Tensor]:
    """What checks the update a table is about to receive: this step's (ids, grads, learning
    rate), or with pipelining the one held from the previous step (this step's is checked when
    held); with no ids, only the held one (a flush)."""
    rule, state = self.rule(table), self.state(table).copies()[0]  # the copies are equal
    check = functools.partial(finite.check_update, table.name, rule, state)
    if not self._pipelining:
      return [check(ids, grads, learning_rate, table_rows)]
    checks = [self._pending[table.name].copies()[0].when_held(check)]
    if ids is not None:
      checks.append(finite.check_row_gradients(grads, table.name))
    return checks

  def _update(
    self,
    table: TableConfig,
    ids: tf.Tensor,
    grads: tf.Tensor,
    learning_rate: tf.Tensor,
    table_rows: Optional[tf.Tensor] = None,
  ) -> None:
    rule, state = self.rule(table), self.state(table)
    if table.name in self._shard_locks:
      self._shard_locks[table.name].apply(rule, state, ids, grads, learning_rate)
      return
    # Parameter-server workers update the shared tables concurrently.
    atomic = self._distribution is Distribution.PARAMETER_SERVERS
    apply = functools.partial(updates.apply_sparse_update, rule, atomic=atomic)
    if not self._pipelining:
      for copy, _ in _on_each_device(state):
        apply(copy, ids, grads, learning_rate, table_rows)
      return
    for copy, pending in _on_each_device(state, self._pending[table.name]):
      # Pipelining: this step's update waits until after the next step's lookup (SPEC §6).
      pending.apply(functools.partial(apply, copy))
      pending.hold(ids, grads, learning_rate)

  def flush(self) -> None:
    """Applies pipelined updates still pending, e.g. before a checkpoint or an evaluation."""
    if not self._pipelining:
      return
    checks = []
    if self._check_finite:
      checks = [check for table in self._tables for check in self._check_update(table)]
    with tf.control_dependencies(checks):
      self._apply_held(self._tables)

  def _apply_held(self, tables: Sequence[TableConfig]) -> None:
    for table in tables:
      rule = self.rule(table)
      for copy, pending in _on_each_device(self.state(table), self._pending[table.name]):
        pending.apply(functools.partial(updates.apply_sparse_update, rule, copy))

  def learning_rate(self, table: TableConfig, checked: bool = False) -> tf.Tensor:
    """The table's learning rate for this step (checked to be finite with `check_finite`,
    unless `checked` already)."""
    return self.learning_rates([table], checked)[0]

  def learning_rates(self, tables: Sequence[TableConfig], checked: bool = False) -> list:
    """`learning_rate` of each table, each learning rate the tables share computed once (as
    the TPU engine calls each learning-rate callable once per step): a Keras schedule builds
    a dozen ops per call, and once per table it was most of Model Garden's first step."""
    computed = {}
    for table in tables:
      if id(table.optimizer.learning_rate) not in computed:
        computed[id(table.optimizer.learning_rate)] = optimizer_specs.learning_rate_tensor(
          table.optimizer, where=f"Table {table.name!r}"
        )
    rates = [computed[id(table.optimizer.learning_rate)] for table in tables]
    if self._check_finite and not checked:
      rates = [finite.check_learning_rate(r, t.name) for r, t in zip(rates, tables)]
    return rates

  def rule(self, table: TableConfig) -> updates.UpdateRule:
    return self._rules[table.name]

  def state(self, table: TableConfig) -> TableState:
    return TableState.of(self._variables[table.name], self.rule(table).slot_names)


def _on_each_device(
  state: TableState, pending: Optional[PendingUpdate] = None
) -> Iterator[tuple[TableState, Optional[PendingUpdate]]]:
  """Each device's copy of a table's state (and of its held update), with that device the
  default while it is in hand; one copy if not distributed.

  Every copy of a mirrored variable receives the same update from the same global gradient,
  which keeps the copies identical without any table-sized communication.
  """
  copies = exchange.copies_to_update(state)
  held = pending.copies() if pending is not None else [None] * len(copies)
  for copy, pending_copy in zip(copies, held):
    with tf.device(copy.parameters.device):
      yield copy, pending_copy
