"""With `check_finite`, a step refused for a non-finite gradient leaves every map as it was.

The map's step runs in the forward pass (its rows are what the lookup reads), but the verdict on
the step's gradients comes in the backward pass. So a layer with `check_finite` keeps, for the
call's map steps, what they changed: each map's variables and candidates before the step, and
the values the resets overwrote in the rows given to new keys. The gradient of the call's
outputs, before it reaches any table, puts them back if it holds a NaN or Inf: the check that
follows refuses the step, and the map, the given rows and their slots are as before the call.

What is undone: the steps refused for their activations' gradients (the check every step
makes first). A step refused later, for a learning rate or an update that overflows, keeps its
map step (docs/reliability.md). A map step that a later call built on is never undone.
"""

from __future__ import annotations

from typing import Any, Mapping

import tensorflow as tf

from tpu_embedding.managed_ids.id_map import IdMap


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
