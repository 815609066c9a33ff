"""A map's two key -> row tables: the compiled kernel's own (TF's `MapTable` left empty) and TF's
(filled, on TF's ops). A checkpoint of either kind, written eagerly or in a `tf.function`,
restores into the other; a map stays on the kernels it was made on; the kernel's table follows
assignments behind it, survives dense churn and refuses variables that give a key two rows.
Rows against the plain-Python reference map or worked by hand."""

import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding.engine import native
from tpu_embedding.managed_ids import IdMap, ManagedIds

from managed_ids_reference import ReferenceMap


def _map(capacity: int, eviction: str = "lru") -> IdMap:
  return IdMap(ManagedIds(eviction=eviction, lfu_half_life_steps=4), "t", capacity)


def _steps(id_map: IdMap, reference: ReferenceMap, batches) -> None:
  for keys in batches:
    rows, fresh = id_map.remap(tf.constant(keys, tf.int64), True)
    expected_rows, expected_fresh = reference.train(keys)
    np.testing.assert_array_equal(rows.numpy(), expected_rows)
    np.testing.assert_array_equal(fresh.numpy(), expected_fresh)


def _batches(seed: int, steps: int, universe: int = 60, size: int = 9):
  rng = np.random.default_rng(seed)
  keys = rng.integers(-(2**62), 2**62, size=universe)
  return [keys[rng.integers(0, universe, size)].tolist() for _ in range(steps)]


def _use(monkeypatch, path: str) -> None:
  monkeypatch.setenv(native.ENV_SWITCH, "1" if path == "native" else "0")


@pytest.mark.parametrize("saved_on, restored_on", [("native", "tf_ops"), ("tf_ops", "native")])
def test_a_checkpoint_restores_into_either_kind_of_map(
  saved_on, restored_on, tmp_path, monkeypatch
):
  _use(monkeypatch, saved_on)
  saved, reference = _map(12, "lfu"), ReferenceMap(12, "lfu", half_life=4)
  _steps(saved, reference, _batches(1, 15))
  # The kernel keeps its own table: TF's stays empty (the memory the kernel saves).
  assert (int(saved.rows_of_keys.size()) == 0) == (saved_on == "native")
  path = tf.train.Checkpoint(m=saved).write(str(tmp_path / "ckpt"))

  _use(monkeypatch, restored_on)
  restored = _map(12, "lfu")
  restored.remap(tf.constant([5, 6, 7], tf.int64), True)  # state of its own, to be replaced
  tf.train.Checkpoint(m=restored).read(path).assert_consumed()
  assert (int(restored.rows_of_keys.size()) == 0) == (restored_on == "native")
  probe = sorted({k for batch in _batches(1, 15) for k in batch}) + [5, 6, 7]
  np.testing.assert_array_equal(
    restored.lookup(tf.constant(probe, tf.int64)), reference.lookup(probe)
  )
  assert int(restored.size()) == len(reference.row_of)
  _steps(restored, reference, _batches(2, 10))


def test_a_map_stays_on_the_kernels_when_they_are_switched_off_after_it_was_made(monkeypatch):
  """Its traces hold the kernels already: a map moving to TF's table would have two tables."""
  _use(monkeypatch, "native")
  id_map, reference = _map(10), ReferenceMap(10, "lru")
  batches = _batches(3, 16, universe=14)
  step = tf.function(lambda keys: id_map.remap(keys, True))
  for keys in batches[:8]:
    np.testing.assert_array_equal(step(tf.constant(keys, tf.int64))[0], reference.train(keys)[0])
  _use(monkeypatch, "tf_ops")
  for keys in batches[8:12]:  # the trace made before the switch
    np.testing.assert_array_equal(step(tf.constant(keys, tf.int64))[0], reference.train(keys)[0])
  _steps(id_map, reference, batches[12:])  # eagerly, after the switch
  probe = sorted(reference.row_of) + [12345]
  np.testing.assert_array_equal(
    id_map.lookup(tf.constant(probe, tf.int64)), reference.lookup(probe)
  )
  assert int(id_map.rows_of_keys.size()) == 0


def test_variables_assigned_behind_the_kernel_are_read_at_its_next_step(monkeypatch):
  """An assignment of `keys` or `last_seen` alone (not `step`): the kernel's table is rebuilt
  from them. By hand: rows 1-3 hold 100, 200, 300 after the assignment, row 2 is then freed."""
  _use(monkeypatch, "native")
  id_map = _map(6)
  id_map.remap(tf.constant([1, 2, 3], tf.int64), True)
  id_map.keys.assign(tf.constant([0, 100, 200, 300, 0, 0], tf.int64))
  np.testing.assert_array_equal(
    id_map.lookup(tf.constant([1, 100, 200, 300], tf.int64)), [0, 1, 2, 3]
  )
  id_map.last_seen.assign(tf.constant([-1, 1, -1, 1, -1, -1], tf.int32))
  rows, fresh = id_map.remap(tf.constant([100, 7, 200], tf.int64), True)
  np.testing.assert_array_equal(rows, [1, 2, 4])  # 7 and 200 take the free rows 2 and 4
  np.testing.assert_array_equal(fresh, [2, 4])
  np.testing.assert_array_equal(id_map.lookup(tf.constant([300, 7, 200], tf.int64)), [3, 2, 4])


def test_a_checkpoint_written_in_a_tf_function_holds_the_map(tmp_path, monkeypatch):
  _use(monkeypatch, "native")
  saved = _map(8)
  saved.remap(tf.constant([10, 20, 30], tf.int64), True)
  checkpoint = tf.train.Checkpoint(m=saved)
  tf.function(lambda: checkpoint.write(str(tmp_path / "ckpt")))()
  _use(monkeypatch, "tf_ops")
  restored = _map(8)
  tf.train.Checkpoint(m=restored).read(str(tmp_path / "ckpt")).assert_consumed()
  np.testing.assert_array_equal(
    restored.lookup(tf.constant([10, 20, 30, 40], tf.int64)), [1, 2, 3, 0]
  )
  rows, _ = restored.remap(tf.constant([10, 40], tf.int64), True)
  np.testing.assert_array_equal(rows, [1, 4])


@pytest.mark.parametrize("eviction", ["lru", "ttl"])
def test_the_kernel_table_survives_dense_churn(eviction, monkeypatch):
  """40 rows in 64 slots (the table's most crowded), ~10 keys replaced a step for 300 steps: long
  probe runs wrapping round the slots' end, removals moving entries back; rows and lookups stay
  the reference's. Keys that differ only in their high bits, as raw ids often do."""
  _use(monkeypatch, "native")
  spec = dict(eviction=eviction, ttl_steps=3 if eviction == "ttl" else None)
  id_map = IdMap(ManagedIds(**spec), "t", 40)
  reference = ReferenceMap(40, **spec)
  rng = np.random.default_rng(7)
  universe = (np.arange(1, 400, dtype=np.int64) << 40).tolist()
  for s in range(300):
    keys = [universe[i] for i in (rng.integers(0, 30, 20) + s) % len(universe)]
    _steps(id_map, reference, [keys])
  probe = universe[:350]
  np.testing.assert_array_equal(
    id_map.lookup(tf.constant(probe, tf.int64)), reference.lookup(probe)
  )


def test_variables_giving_a_key_two_rows_are_refused_naming_the_table(monkeypatch):
  _use(monkeypatch, "native")
  id_map = _map(6)
  id_map.remap(tf.constant([1, 2, 3], tf.int64), True)
  id_map.keys.scatter_update(tf.IndexedSlices(tf.constant([1], tf.int64), [3]))  # 1 at rows 1, 3
  id_map.step.assign(int(id_map.step.numpy()))  # a write the kernel's index did not make
  before = [v.numpy().copy() for v in (id_map.keys, id_map.counts, id_map.last_seen, id_map.step)]
  for call in (lambda: id_map.remap(tf.constant([4], tf.int64), True), lambda: id_map.lookup([1])):
    with pytest.raises(
      tf.errors.InvalidArgumentError, match="Table 't'.*one key two rows: 1 and 3"
    ):
      call()
  after = (id_map.keys, id_map.counts, id_map.last_seen, id_map.step)
  for old, variable in zip(before, after):
    np.testing.assert_array_equal(old, variable.numpy())
