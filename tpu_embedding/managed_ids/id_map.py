"""`IdMap`: one table's key -> row map, with admission, eviction and ages.

Its state is TensorFlow's own machinery (a `MutableHashTable` and variables), so the map runs
eagerly and in `tf.function`, is saved by `tf.train.Checkpoint` and exported in SavedModels.
No decision depends on a hash table's iteration order: free rows are taken in row order, victims
by an explicit order, candidates are pruned after a full sort (docs/managed-ids.md). The choice
of rows for new keys, the one step that would read the whole map, runs in the engine's compiled
kernel where it can (`native.managed_rows_to_give`, from an eviction index kept between steps
and rebuilt from the variables whenever something else wrote them), else in TF ops with the
same result.
"""

from __future__ import annotations

import uuid
import weakref
from typing import NamedTuple, Optional

import tensorflow as tf

from tpu_embedding.engine import native
from tpu_embedding.managed_ids.key_row_map import Reset
from tpu_embedding.managed_ids.spec import ManagedIds

_MAX_SHIFT = 62  # counts are halved at most this often: any longer absence gives 0
_INT32_MAX = 2**31 - 1  # counts saturate there; steps may not pass it (last_seen is int32)


class IdMap(tf.Module):
  """The map of one managed table: row 0 is out of vocabulary, rows 1.. belong to keys."""

  def __init__(self, spec: ManagedIds, table_name: str, capacity: int):
    super().__init__()
    spec.check_capacity(table_name, capacity)
    self.spec = spec
    self.table_name = table_name
    self.capacity = capacity
    dtype = spec.key_dtype
    empty = tf.constant("" if dtype == tf.string else 0, dtype)
    with tf.init_scope():
      self.rows_of_keys = tf.lookup.experimental.MutableHashTable(dtype, tf.int64, 0)
      self.candidates = (
        tf.lookup.experimental.MutableHashTable(dtype, tf.int64, 0) if spec.min_count > 1 else None
      )
      self.keys = _variable(tf.fill([capacity], empty), table_name, "keys")
      # A row's count was last updated when its key was last seen: its age is
      # `last_seen // lfu_half_life_steps` epochs, so no per-row epoch is stored. Both are
      # int32 (4 bytes a row each): counts saturate at 2**31 - 1, steps stop there.
      self.counts = _variable(tf.zeros([capacity], tf.int32), table_name, "counts")
      self.last_seen = _variable(
        tf.fill([capacity], tf.constant(-1, tf.int32)), table_name, "last_seen"
      )
      self.step = _variable(tf.constant(0, tf.int64), table_name, "step")
    # The compiled kernel's eviction index: a cache of the variables above, not checkpointed.
    self.index_name = f"tpu_embedding_managed_index_{uuid.uuid4().hex}"
    weakref.finalize(self, _destroy_index, self.index_name).atexit = False

  @property
  def key_dtype(self) -> tf.DType:
    return self.spec.key_dtype

  # -------------------------------------------------------------------------------------------
  # Reading

  def lookup(self, keys: tf.Tensor) -> tf.Tensor:
    """Rows of `keys` (0 for keys without a row); never admits, evicts or counts."""
    return self.rows_of_keys.lookup(tf.convert_to_tensor(keys, self.key_dtype))

  def size(self) -> tf.Tensor:
    """How many keys hold a row."""
    return self.rows_of_keys.size()

  def export(self) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(keys, rows, counts) of every key holding a row, by ascending row; counts (int64) aged to
    now."""
    rows = tf.where(self._used_rows())[:, 0]
    return tf.gather(self.keys, rows), rows, self._aged_counts(rows, self._epoch(self.step))

  def serving_tables(self) -> list[tf.lookup.experimental.MutableHashTable]:
    """The hash table a serving lookup reads (a SavedModel must hold it)."""
    return [self.rows_of_keys]

  def reindex(self) -> None:
    """Makes the hash tables agree with the variables after something assigned them (Keras
    loading a weight file, which holds the variables but no hash table): every key the variables
    give a row finds it again; keys still waiting for admission (`min_count`) count anew."""
    keys, rows, _ = self.export()
    for table in (self.rows_of_keys, self.candidates):
      if table is not None:
        table.remove(table.export()[0])
    self.rows_of_keys.insert(keys, rows)

  # -------------------------------------------------------------------------------------------
  # One training step

  @tf.autograph.experimental.do_not_convert
  def remap(
    self, keys: tf.Tensor, training: bool, reset: Optional[Reset] = None
  ) -> tuple[tf.Tensor, tf.Tensor]:
    """(row of each key, rows given to new keys this step), the latter passed to `reset`.

    With `training`, this is one step of the map: counts and ages advance, eligible keys are
    admitted in order of first occurrence, victims are freed. Otherwise a plain lookup.
    """
    if not training:
      return self.lookup(keys), tf.zeros([0], tf.int64)
    tf.debugging.assert_less(
      self.step.read_value(),
      tf.constant(_INT32_MAX, tf.int64),
      message=f"Table {self.table_name!r}: its managed-id map has counted 2**31 - 1 training "
      "steps, the most its int32 last-seen steps record; nothing was changed",
    )
    compiled = native.runs_here([self.last_seen, self.counts, self.step])
    if compiled:
      with tf.device(self.step.device):
        step = native.managed_next_step(native.managed_index(self.index_name), self.step)
    else:
      step = self.step.assign_add(1)
    unique, position = tf.unique(keys, out_idx=tf.int64)
    occurrences = tf.math.unsorted_segment_sum(
      tf.ones_like(position), position, tf.size(unique, tf.int64)
    )
    rows = tf.reshape(self.rows_of_keys.lookup(unique), [-1])
    known = rows > 0
    seen = tf.boolean_mask(rows, known)
    self._count_hits(seen, tf.boolean_mask(occurrences, known), step)
    freed = self._free_expired(step) if self.spec.eviction == "ttl" else tf.zeros([0], tf.int64)
    places = _Places(step, seen, freed, compiled)
    newcomers = tf.where(~known)[:, 0]
    new_rows, admitted = self._admit(
      tf.gather(unique, newcomers), tf.gather(occurrences, newcomers), places
    )
    if reset is not None:
      reset(new_rows)
    # Keys seen in this step keep their rows (never evicted, never expired by it): only the
    # admitted ones change.
    rows = tf.tensor_scatter_nd_update(rows, tf.gather(newcomers, admitted)[:, None], new_rows)
    return tf.gather(rows, position), new_rows

  def _count_hits(self, rows: tf.Tensor, occurrences: tf.Tensor, step: tf.Tensor) -> None:
    aged = self._aged_counts(rows, self._epoch(step))
    self.counts.scatter_update(tf.IndexedSlices(_saturated(aged + occurrences), rows))
    self.last_seen.scatter_update(tf.IndexedSlices(_steps(rows, step), rows))

  def _free_expired(self, step: tf.Tensor) -> tf.Tensor:
    """TTL: rows unseen for `ttl_steps` steps lose their keys (which read row 0 again); returns
    those rows."""
    last = tf.cast(self.last_seen.read_value(), tf.int64)
    expired = tf.where(self._used_rows(last) & (step - last >= self.spec.ttl_steps))[:, 0]
    self.rows_of_keys.remove(tf.gather(self.keys, expired))
    self.last_seen.scatter_update(
      tf.IndexedSlices(tf.fill(tf.shape(expired), tf.constant(-1, tf.int32)), expired)
    )
    return expired

  def _admit(
    self, keys: tf.Tensor, occurrences: tf.Tensor, places: _Places
  ) -> tuple[tf.Tensor, tf.Tensor]:
    """Gives rows to the eligible ones of `keys` (new keys in first-occurrence order): (the rows,
    the positions in `keys` of the keys given them)."""
    step = places.step
    if self.candidates is not None:
      totals = tf.reshape(self.candidates.lookup(keys), [-1]) + occurrences
      eligible = totals >= self.spec.min_count
    else:
      totals, eligible = occurrences, tf.ones_like(occurrences, tf.bool)
    chosen_keys, chosen_totals = tf.boolean_mask(keys, eligible), tf.boolean_mask(totals, eligible)
    rows = self._rows_to_give(tf.size(chosen_keys, tf.int64), places)
    placed = tf.size(rows)
    admitted = chosen_keys[:placed]
    previous = tf.gather(self.keys, rows)
    self.rows_of_keys.remove(tf.boolean_mask(previous, tf.gather(self.last_seen, rows) >= 0))
    self.rows_of_keys.insert(admitted, rows)
    self.keys.scatter_update(tf.IndexedSlices(admitted, rows))
    self.counts.scatter_update(tf.IndexedSlices(_saturated(chosen_totals[:placed]), rows))
    self.last_seen.scatter_update(tf.IndexedSlices(_steps(rows, step), rows))
    if self.candidates is not None:
      self.candidates.remove(admitted)
      waiting = tf.concat([tf.boolean_mask(keys, ~eligible), chosen_keys[placed:]], 0)
      waiting_totals = tf.concat([tf.boolean_mask(totals, ~eligible), chosen_totals[placed:]], 0)
      self.candidates.insert(waiting, waiting_totals)
      self._prune_candidates()
    return rows, tf.where(eligible)[:placed, 0]

  def _rows_to_give(self, wanted: tf.Tensor, places: _Places) -> tf.Tensor:
    """Up to `wanted` rows: free rows by ascending index, then victims in eviction order among
    rows whose key was not seen in this step."""
    step = places.step
    if places.compiled:
      with tf.device(self.step.device):
        return native.managed_rows_to_give(
          native.managed_index(self.index_name),
          self.last_seen,
          self.counts,
          step,
          wanted,
          places.seen,
          places.freed,
          self.spec.eviction,
          self.spec.lfu_half_life_steps,
        )
    last = tf.cast(self.last_seen.read_value(), tf.int64)
    index = tf.range(self.capacity, dtype=tf.int64)
    free = tf.where((last < 0) & (index > 0))[:, 0]

    def with_victims() -> tf.Tensor:
      victims = tf.where(self._used_rows(last) & (last < step))[:, 0]  # ascending rows
      order = tf.argsort(tf.gather(last, victims), stable=True)  # least recently seen first
      if self.spec.eviction == "lfu":
        aged = self._aged_counts(tf.gather(victims, order), self._epoch(step), last)
        order = tf.gather(order, tf.argsort(aged, stable=True))
      ranked = tf.concat([free, tf.gather(victims, order)], 0)
      return ranked[: tf.minimum(wanted, tf.size(ranked, tf.int64))]

    enough = tf.size(free, tf.int64) >= wanted
    return tf.cond(enough, lambda: free[:wanted], with_victims)

  def _prune_candidates(self) -> None:
    """Keeps the `candidate_capacity` highest candidate counts once twice as many are held;
    ties keep the smaller key (strings: the smaller 64-bit fingerprint)."""
    bound = self.spec.candidate_capacity or self.capacity

    def prune() -> tf.Tensor:
      keys, counts = (tf.reshape(t, [-1]) for t in self.candidates.export())
      order = tf.argsort(_tie_breaker(keys), stable=True)
      order = tf.gather(
        order, tf.argsort(tf.gather(counts, order), direction="DESCENDING", stable=True)
      )
      self.candidates.remove(tf.gather(keys, order[bound:]))
      return tf.constant(0)

    tf.cond(self.candidates.size() > 2 * bound, prune, lambda: tf.constant(0))

  # -------------------------------------------------------------------------------------------

  def _epoch(self, step: tf.Tensor) -> tf.Tensor:
    return step // self.spec.lfu_half_life_steps

  def _aged_counts(
    self, rows: tf.Tensor, epoch: tf.Tensor, last_seen: tf.Tensor = None
  ) -> tf.Tensor:
    """Counts of `rows` (holding keys) aged to `epoch`, from `last_seen` (default: read now)."""
    last = self.last_seen if last_seen is None else last_seen
    counted_at = self._epoch(tf.cast(tf.gather(last, rows), tf.int64))
    halvings = tf.minimum(epoch - counted_at, _MAX_SHIFT)
    return tf.bitwise.right_shift(tf.cast(tf.gather(self.counts, rows), tf.int64), halvings)

  def _used_rows(self, last_seen: tf.Tensor = None) -> tf.Tensor:
    last = self.last_seen.read_value() if last_seen is None else last_seen
    return (last >= 0) & (tf.range(self.capacity, dtype=tf.int64) > 0)


class _Places(NamedTuple):
  """What the choice of rows for new keys needs to know about its step."""

  step: tf.Tensor
  seen: tf.Tensor  # rows whose keys were counted at this step
  freed: tf.Tensor  # rows freed at this step (TTL)
  compiled: bool  # whether the compiled kernel (and its index) chooses


def _saturated(counts: tf.Tensor) -> tf.Tensor:
  """int64 counts as the int32 `counts` variable holds them: at most 2**31 - 1."""
  return tf.cast(tf.minimum(counts, _INT32_MAX), tf.int32)


def _steps(rows: tf.Tensor, step: tf.Tensor) -> tf.Tensor:
  """`step` (at most 2**31 - 1, checked) once per row, as the int32 `last_seen` holds it."""
  return tf.fill(tf.shape(rows), tf.cast(step, tf.int32))


def _destroy_index(name: str) -> None:
  if native.enabled():
    native.destroy_managed_index(name)


def _variable(initial_value: tf.Tensor, table_name: str, name: str) -> tf.Variable:
  # Named after the table: tf-keras's legacy HDF5 files name each weight's dataset after its
  # variable, so the maps of two tables in one layer need different names.
  return tf.Variable(initial_value, trainable=False, name=f"managed_ids/{table_name}/{name}")


def _tie_breaker(keys: tf.Tensor) -> tf.Tensor:
  if keys.dtype == tf.string:
    return tf.strings.to_hash_bucket_fast(keys, 2**63 - 1)
  return keys
