"""A map's two key -> row tables: the compiled kernel's own (TF's `MapTable` left empty) and TF's
(filled, on TF's ops). A checkpoint of either kind restores into the other; a map whose kernels
are switched off goes on with TF's table; the kernel's table survives dense churn and refuses
variables that give a key two rows. Every row against the plain-Python reference map."""

import numpy as np
import pytest
import tensorflow as tf

from tests.managed_ids_reference import ReferenceMap
from tpu_embedding.engine import native
from tpu_embedding.managed_ids import IdMap, ManagedIds


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


def test_a_map_whose_kernels_are_switched_off_goes_on_with_tf_table(monkeypatch):
  _use(monkeypatch, "native")
  id_map, reference = _map(10), ReferenceMap(10, "lru")
  batches = _batches(3, 16, universe=14)  # the keys held before the switch come again after
  _steps(id_map, reference, batches[:8])
  _use(monkeypatch, "tf_ops")
  _steps(id_map, reference, batches[8:])
  probe = sorted(reference.row_of) + [12345]
  np.testing.assert_array_equal(
    id_map.lookup(tf.constant(probe, tf.int64)), reference.lookup(probe)
  )


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
