"""`IdMap`: one table's key -> row map, with admission, eviction and ages.

Its state is TensorFlow's own machinery (a `MutableHashTable` and variables), so the map runs
eagerly and in `tf.function`, is saved by `tf.train.Checkpoint` and exported in SavedModels.
No decision depends on a hash table's iteration order: free rows are taken in row order, victims
by an explicit order, candidates are pruned after a full sort (docs/managed-ids.md). A training
step runs in one compiled kernel where it can (`native.managed_remap`: the variables updated in
place, keys found in a key -> row table of the kernel's and rows picked from an eviction index,
both kept between steps and rebuilt from the variables whenever something else wrote them), else
in TF ops (a `MutableHashTable`) with the same result. Either way checkpoints and SavedModels take
the map's key -> row pairs from its variables (`MapTable`).

Every map holds int64 keys: a string-key map (`ManagedIds(key_dtype=tf.string)`) holds each
string's fingerprint (`spec.fingerprint`), taken where keys enter (`spec.as_keys`), and is
otherwise an int64 map. Its checkpoints name that variable `fingerprints` rather than `keys`,
so that neither kind of map restores the other's.
"""

from __future__ import annotations

import uuid
import weakref
from typing import Callable, Optional

import tensorflow as tf

from tpu_embedding import tf_internals
from tpu_embedding.engine import lookup, native
from tpu_embedding.managed_ids.spec import SCORED_POLICIES, ManagedIds, Reset, as_keys

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
    with tf.init_scope():
      # Filled only while the map runs on TF's ops (`_on_kernels` False); checkpoints and
      # SavedModels take its entries from the variables either way (MapTable).
      self.rows_of_keys = MapTable(self._pairs, lambda: not self._on_kernels)
      self.candidates = (
        tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, 0)
        if spec.keeps_candidates
        else None
      )
      name = keys_name(spec)
      keys = _variable(tf.zeros([capacity], tf.int64), table_name, name)
      if name == "keys":
        self.keys = keys
      else:  # held as `keys` too, but tracked (in checkpoints) under its own name only
        self.keys = self._no_dependency(keys)
        self._track_trackable(keys, name=name)
      # A row's count was last updated when its key was last seen: its age is
      # `last_seen // lfu_half_life_steps` epochs, so no per-row epoch is stored. Both are
      # int32 (4 bytes a row each): counts saturate at 2**31 - 1, steps stop there.
      self.counts = _variable(tf.zeros([capacity], tf.int32), table_name, "counts")
      self.last_seen = _variable(
        tf.fill([capacity], tf.constant(-1, tf.int32)), table_name, "last_seen"
      )
      self.step = _variable(tf.constant(0, tf.int64), table_name, "step")
    # The compiled kernel's index (key -> row table, eviction order): a cache of the variables
    # above, not checkpointed. Whether the map runs there is settled here, once: the two keep
    # their key -> row tables apart.
    self.index_name = f"tpu_embedding_managed_index_{uuid.uuid4().hex}"
    self._on_kernels = native.runs_here(self._variables())
    weakref.finalize(self, _destroy_index, self.index_name).atexit = False

  @property
  def key_dtype(self) -> tf.DType:
    """What `lookup` takes (strings for a string-key map, held as their fingerprints)."""
    return self.spec.key_dtype

  # -------------------------------------------------------------------------------------------
  # Reading

  def lookup(self, keys: tf.Tensor) -> tf.Tensor:
    """Rows of `keys` (of `key_dtype`; 0 for keys without a row); never admits, evicts or
    counts."""
    return self.rows_of(as_keys(keys, self.key_dtype, f"Table {self.table_name!r}"))

  def rows_of(self, keys: tf.Tensor) -> tf.Tensor:
    """`lookup` of the int64 keys the map holds (`as_keys`'s). In a SavedModel trace, TF's
    table (saved whole, see MapTable)."""
    if self._kernel_runs():
      with tf.device(self.step.device):
        return native.managed_lookup(self._index(), self._variables(), keys, self.table_name)
    return self.rows_of_keys.lookup(keys)

  def size(self) -> tf.Tensor:
    """How many keys hold a row (int64)."""
    return tf.math.count_nonzero(self._used_rows(), dtype=tf.int64)

  def export(self) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(keys, rows, counts) of every key holding a row, by ascending row: the int64 keys held
    (a string-key map's fingerprints), counts (int64) aged to now."""
    rows = tf.where(self._used_rows())[:, 0]
    return tf.gather(self.keys, rows), rows, self._aged_counts(rows, self._epoch(self.step))

  def serving_tables(self) -> list[tf.lookup.experimental.MutableHashTable]:
    """The hash table a serving lookup reads (a SavedModel must hold it)."""
    return [self.rows_of_keys]

  def reindex(self) -> None:
    """Makes the hash tables agree with the variables after something assigned them (Keras
    loading a weight file, which holds the variables but no hash table): every key the variables
    give a row finds it again; keys still waiting for admission (`min_count`) count anew."""
    if self.candidates is not None:
      self.candidates.remove(self.candidates.export()[0])
    if not self._on_kernels:  # the kernel's index rebuilds itself: `step` was assigned
      self.rows_of_keys.remove(self.rows_of_keys.export()[0])
      self.rows_of_keys.insert(*self._pairs())

  def assign(
    self,
    keys: tf.Tensor,
    counts: tf.Tensor,
    last_seen: tf.Tensor,
    step: tf.Tensor,
    candidates: Optional[tuple[tf.Tensor, tf.Tensor]] = None,
  ) -> None:
    """Sets the map's variables and its waiting keys' counts (`candidates`: keys, counts) from
    a file read by hand (an older one, whose string keys were converted); the hash tables
    follow."""
    for variable, value in zip(self._variables(), (keys, counts, last_seen, step)):
      variable.assign(value)
    self.reindex()
    if self.candidates is not None and candidates is not None:
      self.candidates.insert(*candidates)

  # -------------------------------------------------------------------------------------------
  # One training step

  @tf.autograph.experimental.do_not_convert
  def remap(
    self, keys: tf.Tensor, training: bool, reset: Optional[Reset] = None
  ) -> tuple[tf.Tensor, tf.Tensor]:
    """(row of each key, rows given to new keys this step), the latter passed to `reset`;
    `keys`: the int64 keys the map holds (`as_keys`).

    With `training`, this is one step of the map: counts and ages advance, eligible keys are
    admitted in order of first occurrence, victims are freed. Otherwise a plain lookup.
    """
    if not training:
      return self.rows_of(keys), tf.zeros([0], tf.int64)
    if self._kernel_runs():  # it refuses a step past 2**31 - 1 itself
      with tf.device(self.step.device):
        rows, new_rows = native.managed_remap(
          self._index(),
          None if self.candidates is None else self.candidates.resource_handle,
          self._variables(),
          keys,
          self.spec.eviction,
          self.spec.lfu_half_life_steps,
          self.spec.min_count,
          self.spec.ttl_steps,
          self.table_name,
          self.spec.admission == "compete",
          self.spec.distance_decay,
        )
      if self.candidates is not None:
        self._prune_candidates()
    else:
      rows, new_rows = self._remap_with_tf_ops(keys)
    if reset is not None:
      reset(new_rows)
    return rows, new_rows

  def _variables(self) -> list[tf.Variable]:
    return [self.keys, self.counts, self.last_seen, self.step]

  def _index(self) -> tf.Tensor:
    return native.managed_index(self.index_name)

  def _pairs(self) -> tuple[tf.Tensor, tf.Tensor]:
    keys, rows, _ = self.export()
    return keys, rows

  def _kernel_runs(self) -> bool:
    """Whether this call runs on the kernel's index: a map on the kernels (settled when it was
    made: switching the kernels off later leaves it there, its traces already hold them), except
    in what a SavedModel saves, whose lookups read TF's table (saved whole, see MapTable)."""
    return self._on_kernels and not (tf_internals.in_save_context() or lookup.tracing_an_export())

  def _remap_with_tf_ops(self, keys: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """The training step in TF's own ops (no compiled kernels, or a map on another task)."""
    tf.debugging.assert_less(
      self.step.read_value(),
      tf.constant(_INT32_MAX, tf.int64),
      message=f"Table {self.table_name!r}: its managed-id map has counted 2**31 - 1 training "
      "steps, the most its int32 last-seen steps record; nothing was changed",
    )
    step = self.step.assign_add(1)
    unique, position = tf.unique(keys, out_idx=tf.int64)
    occurrences = tf.math.unsorted_segment_sum(
      tf.ones_like(position), position, tf.size(unique, tf.int64)
    )
    rows = tf.reshape(self.rows_of_keys.lookup(unique), [-1])
    known = rows > 0
    self._count_hits(tf.boolean_mask(rows, known), tf.boolean_mask(occurrences, known), step)
    if self.spec.eviction == "ttl":
      self._free_expired(step)
    newcomers = tf.where(~known)[:, 0]
    new_rows, admitted = self._admit(
      tf.gather(unique, newcomers), tf.gather(occurrences, newcomers), step
    )
    # Keys seen in this step keep their rows (never evicted, never expired by it): only the
    # admitted ones change.
    rows = tf.tensor_scatter_nd_update(rows, tf.gather(newcomers, admitted)[:, None], new_rows)
    return tf.gather(rows, position), new_rows

  def _count_hits(self, rows: tf.Tensor, occurrences: tf.Tensor, step: tf.Tensor) -> None:
    aged = self._aged_counts(rows, self._epoch(step))
    self.counts.scatter_update(tf.IndexedSlices(_saturated(aged + occurrences), rows))
    self.last_seen.scatter_update(tf.IndexedSlices(_steps(rows, step), rows))

  def _free_expired(self, step: tf.Tensor) -> None:
    """TTL: rows unseen for `ttl_steps` steps lose their keys (which read row 0 again)."""
    last = tf.cast(self.last_seen.read_value(), tf.int64)
    expired = tf.where(self._used_rows(last) & (step - last >= self.spec.ttl_steps))[:, 0]
    self.rows_of_keys.remove(tf.gather(self.keys, expired))
    self.last_seen.scatter_update(
      tf.IndexedSlices(tf.fill(tf.shape(expired), tf.constant(-1, tf.int32)), expired)
    )

  def _admit(
    self, keys: tf.Tensor, occurrences: tf.Tensor, step: tf.Tensor
  ) -> tuple[tf.Tensor, tf.Tensor]:
    """Gives rows to the eligible ones of `keys` (new keys in first-occurrence order): (the rows,
    the positions in `keys` of the keys given them)."""
    if self.candidates is not None:
      totals = tf.reshape(self.candidates.lookup(keys), [-1]) + occurrences
      eligible = totals >= self.spec.min_count
    else:
      totals, eligible = occurrences, tf.ones_like(occurrences, tf.bool)
    chosen_keys, chosen_totals = tf.boolean_mask(keys, eligible), tf.boolean_mask(totals, eligible)
    free, victims, scores = self._rows_to_give(tf.size(chosen_keys, tf.int64), step)
    picked = self._pick(chosen_totals, tf.size(free, tf.int64), scores)
    rows = tf.concat([free, victims[: tf.size(picked, tf.int64) - tf.size(free, tf.int64)]], 0)
    admitted = tf.gather(chosen_keys, picked)
    previous = tf.gather(self.keys, rows)
    self.rows_of_keys.remove(tf.boolean_mask(previous, tf.gather(self.last_seen, rows) >= 0))
    self.rows_of_keys.insert(admitted, rows)
    self.keys.scatter_update(tf.IndexedSlices(admitted, rows))
    self.counts.scatter_update(tf.IndexedSlices(_saturated(tf.gather(chosen_totals, picked)), rows))
    self.last_seen.scatter_update(tf.IndexedSlices(_steps(rows, step), rows))
    if self.candidates is not None:
      self.candidates.remove(admitted)
      left = tf.tensor_scatter_nd_update(
        tf.ones_like(chosen_totals, tf.bool), picked[:, None], tf.zeros_like(picked, tf.bool)
      )
      waiting = tf.concat([tf.boolean_mask(keys, ~eligible), tf.boolean_mask(chosen_keys, left)], 0)
      waiting_totals = tf.concat(
        [tf.boolean_mask(totals, ~eligible), tf.boolean_mask(chosen_totals, left)], 0
      )
      self.candidates.insert(waiting, waiting_totals)
      self._prune_candidates()
    return rows, tf.gather(tf.where(eligible)[:, 0], picked)

  def _pick(self, totals: tf.Tensor, free: tf.Tensor, scores: tf.Tensor) -> tf.Tensor:
    """Positions in `totals` (eligible new keys) of the keys given rows, in the order of the rows
    they take: the first `free` keys take the free rows; the others take the victims' rows (of
    ascending `scores`) in first-occurrence order, or, competing, strongest first while their
    total beats the victim's score (ties keep the row's key)."""
    rest = tf.range(free, tf.size(totals, tf.int64))
    if self.spec.admission == "compete":
      rest = free + tf.cast(
        tf.argsort(totals[free:], direction="DESCENDING", stable=True), tf.int64
      )
    contested = tf.minimum(tf.size(rest, tf.int64), tf.size(scores, tf.int64))
    if self.spec.admission == "compete":
      # Totals descend and scores ascend: the keys that win are a prefix.
      wins = tf.cast(tf.gather(totals, rest[:contested]), tf.float64) > scores[:contested]
      contested = tf.math.count_nonzero(wins, dtype=tf.int64)
    return tf.concat([tf.range(tf.minimum(free, tf.size(totals, tf.int64))), rest[:contested]], 0)

  def _rows_to_give(
    self, wanted: tf.Tensor, step: tf.Tensor
  ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(up to `wanted` free rows by ascending index, victims for the rest in eviction order among
    rows whose key was not seen in this step, the victims' scores (float64))."""
    last = tf.cast(self.last_seen.read_value(), tf.int64)
    index = tf.range(self.capacity, dtype=tf.int64)
    free = tf.where((last < 0) & (index > 0))[:, 0]
    free = free[: tf.minimum(wanted, tf.size(free, tf.int64))]

    def with_victims() -> tuple[tf.Tensor, tf.Tensor]:
      victims = tf.where(self._used_rows(last) & (last < step))[:, 0]  # ascending rows
      order = tf.argsort(tf.gather(last, victims), stable=True)  # least recently seen first
      scores = tf.zeros(tf.shape(victims), tf.float64)
      if self.spec.eviction in SCORED_POLICIES:
        scores = self._scores(tf.gather(victims, order), step, last)
        order = tf.gather(order, tf.argsort(scores, stable=True))
        scores = tf.sort(scores)
      more = tf.minimum(wanted - tf.size(free, tf.int64), tf.size(victims, tf.int64))
      return tf.gather(victims, order)[:more], scores[:more]

    def without() -> tuple[tf.Tensor, tf.Tensor]:
      return tf.zeros([0], tf.int64), tf.zeros([0], tf.float64)

    victims, scores = tf.cond(tf.size(free, tf.int64) < wanted, with_victims, without)
    return free, victims, scores

  def _scores(self, rows: tf.Tensor, step: tf.Tensor, last: tf.Tensor) -> tf.Tensor:
    """The eviction scores (float64) of `rows` (holding keys, none seen at `step`): the aged
    count, or for distance_lfu count / distance ** decay (a power in halves: products and a
    square root, exactly rounded as the kernel and the reference compute them)."""
    counts = self._aged_counts(rows, self._epoch(step), last)
    if self.spec.eviction != "distance_lfu":
      return tf.cast(counts, tf.float64)
    distance = tf.cast(step - tf.gather(last, rows), tf.float64)
    power = tf.ones_like(distance)
    for _ in range(int(self.spec.distance_decay)):
      power = power * distance
    if self.spec.distance_decay % 1:
      power = power * tf.sqrt(distance)
    return tf.cast(counts, tf.float64) / power

  def _prune_candidates(self) -> None:
    """Keeps the `candidate_capacity` highest candidate counts once twice as many are held;
    ties keep the smaller key."""
    bound = self.spec.candidate_capacity or self.capacity

    def prune() -> tf.Tensor:
      keys, counts = (tf.reshape(t, [-1]) for t in self.candidates.export())
      order = tf.argsort(keys, stable=True)
      order = tf.gather(
        order, tf.argsort(tf.gather(counts, order), direction="DESCENDING", stable=True)
      )
      self.candidates.remove(tf.gather(keys, order[bound:]))
      return tf.constant(0)

    tf.cond(self.candidates.size() > 2 * bound, prune, lambda: tf.constant(0))

  # -------------------------------------------------------------------------------------------

  def _epoch(self, step: tf.Tensor) -> tf.Tensor:
    if self.spec.eviction == "distance_lfu":  # counts are never halved
      return tf.zeros_like(step)
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


def _saturated(counts: tf.Tensor) -> tf.Tensor:
  """int64 counts as the int32 `counts` variable holds them: at most 2**31 - 1."""
  return tf.cast(tf.minimum(counts, _INT32_MAX), tf.int32)


def _steps(rows: tf.Tensor, step: tf.Tensor) -> tf.Tensor:
  """`step` (at most 2**31 - 1, checked) once per row, as the int32 `last_seen` holds it."""
  return tf.fill(tf.shape(rows), tf.cast(step, tf.int32))


def _destroy_index(name: str) -> None:
  if native.enabled():
    native.destroy_managed_index(name)


# What a string-key map's checkpoints call its keys variable (an int64-key map's: `keys`).
FINGERPRINTS = "fingerprints"


def keys_name(spec: ManagedIds) -> str:
  """What a map's checkpoints call its keys variable."""
  return FINGERPRINTS if spec.key_dtype == tf.string else "keys"


def _variable(initial_value: tf.Tensor, table_name: str, name: str) -> tf.Variable:
  # Named after the table: tf-keras's legacy HDF5 files name each weight's dataset after its
  # variable, so the maps of two tables in one layer need different names.
  return tf.Variable(initial_value, trainable=False, name=f"managed_ids/{table_name}/{name}")


# ---------------------------------------------------------------------------------------------
# `MapTable`: TF's hash table of one map, saved from the map's variables.
#
# A map on the compiled kernels keeps its key -> row table in the kernel's index (a cache of the
# variables, ~4x smaller than TF's node-based table) and leaves this one empty; a map on TF's ops
# (no kernels, or its variables on another task) keeps this one filled. Either way checkpoints and
# SavedModels hold the same pairs, taken from the variables, so a SavedModel's table (read by
# processes that import only TensorFlow) is whole, and a checkpoint restores into either kind.

# The map's (keys, rows) of every key holding a row, read from its variables.
Pairs = Callable[[], tuple[tf.Tensor, tf.Tensor]]


class MapTable(tf.lookup.experimental.MutableHashTable):
  """A `MutableHashTable(int64 key -> int64 row, default 0)` whose checkpoint entries come from
  `pairs()` and are restored into it only where `filled()` (the map reads this table)."""

  def __init__(self, pairs: Pairs, filled: Callable[[], bool]):
    super().__init__(tf.int64, tf.int64, 0)
    self._pairs = pairs
    self._filled = filled

  def _serialize_to_tensors(self) -> dict[str, tf.Tensor]:
    # Traced for a SavedModel's own save function, the table is that of the loaded SavedModel,
    # always filled; the map's variables may not be part of what is saved.
    if in_save_trace():
      return super()._serialize_to_tensors()
    keys, rows = self._pairs()
    return {"-keys": keys, "-values": rows}

  def _restore_from_tensors(self, restored_tensors: dict[str, tf.Tensor]):
    # Traced for a SavedModel's restore function, it fills the loaded table.
    if not (self._filled() or in_save_trace()):
      return tf.no_op()
    return super()._restore_from_tensors(restored_tensors)


def in_save_trace() -> bool:
  """Whether a SavedModel's functions are being traced (not a checkpoint written or read in a
  `tf.function`, which runs here and reads the map's variables)."""
  return tf_internals.in_save_context() and not tf.executing_eagerly()
