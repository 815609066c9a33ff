"""`IdMap` against the plain-Python reference map, step by step, eager and in tf.function; and its
two key -> row tables (the kernel's and TF's `MapTable`)."""

import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding.engine import native
from tpu_embedding.managed_ids import IdMap, ManagedIds
from tpu_embedding.managed_ids.spec import as_keys

from managed_ids_reference import ReferenceMap, fingerprints

POLICIES = [
  dict(eviction="lfu", half_life=3, admission="always"),
  dict(eviction="lru"),
  dict(eviction="ttl", ttl_steps=2),
  dict(eviction="lfu", half_life=3, admission="compete"),
  dict(eviction="distance_lfu"),
  dict(eviction="distance_lfu", distance_decay=0.5, admission="compete"),
  dict(eviction="distance_lfu", distance_decay=1.5, admission="compete"),
]


def _policy_id(policy: dict) -> str:
  return "-".join(str(v) for k, v in policy.items() if k != "half_life")


def _stream(seed: int, steps: int, string: bool):
  """Zipf-like keys, negative and above 2**31 among them, popularity drifting over the steps."""
  rng = np.random.default_rng(seed)
  universe = rng.integers(-(2**62), 2**62, size=40)
  universe[:3] = [-7, 2**31 + 5, 0]
  for step in range(steps):
    ranks = (rng.zipf(1.5, size=int(rng.integers(1, 12))) + step // 3) % len(universe)
    keys = universe[ranks]
    yield [f"k{k}".encode() for k in keys] if string else [int(k) for k in keys]


def _id_map(capacity, eviction, min_count, ttl_steps=None, half_life=1000, string=False, **kw):
  spec = ManagedIds(
    key_dtype=tf.string if string else tf.int64,
    eviction=eviction,
    min_count=min_count,
    ttl_steps=ttl_steps,
    lfu_half_life_steps=half_life,
    **kw,
  )
  return IdMap(spec, "t", capacity)


@pytest.mark.parametrize("policy", POLICIES, ids=_policy_id)
@pytest.mark.parametrize("min_count", [1, 3])
@pytest.mark.parametrize("string", [False, True])
@pytest.mark.parametrize("traced", [False, True])
def test_map_follows_reference(policy, min_count, string, traced, engine_path):
  """On both paths (the engine's compiled kernel choosing rows, and TF ops alone). A string-key
  map is the int64 map of its strings' fingerprints, taken as keys enter (`as_keys`)."""
  id_map = _id_map(6, min_count=min_count, string=string, **policy)
  reference = ReferenceMap(6, min_count=min_count, **policy)
  step = id_map.remap
  if traced:
    step = tf.function(id_map.remap, reduce_retracing=True)
    graph = step.get_concrete_function(tf.TensorSpec([None], tf.int64), True).graph
    ops = {op.type for op in graph.get_operations()}
    assert ("TpuEmbeddingManagedRemap" in ops) == (engine_path == "native")
  admitted = 0
  for keys in _stream(seed=min_count + 10 * string, steps=30, string=string):
    rows, fresh = step(as_keys(tf.constant(keys), id_map.key_dtype, "t"), True)
    expected_rows, expected_fresh = reference.train(fingerprints(keys) if string else keys)
    np.testing.assert_array_equal(rows.numpy(), expected_rows)
    np.testing.assert_array_equal(fresh.numpy(), expected_fresh)
    admitted += len(expected_fresh)
    keys_, rows_, counts_ = id_map.export()
    expected = reference.export()
    assert list(keys_.numpy()) == expected[0]
    np.testing.assert_array_equal(rows_.numpy(), expected[1])
    np.testing.assert_array_equal(counts_.numpy(), expected[2])
  assert admitted > 5  # the stream exercised admission and eviction
  assert int(id_map.size()) == len(reference.row_of)


def test_candidates_are_bounded_and_pruned_by_count_then_key():
  id_map = _id_map(3, "lru", min_count=3, candidate_capacity=2)
  reference = ReferenceMap(3, "lru", min_count=3, candidate_capacity=2)
  for step, keys in enumerate(([1, 2, 2], [3, 4, 4, 5], [6, 7], [2, 4, 1, 1])):
    rows, _ = id_map.remap(tf.constant(keys, tf.int64), True)
    np.testing.assert_array_equal(rows.numpy(), reference.train(keys)[0])
    keys, counts = id_map.candidates.export()
    assert dict(zip(keys.numpy().tolist(), counts.numpy().tolist())) == reference.candidates
    if step == 1:  # after [3, 4, 4, 5]: five candidates pruned to the two largest
      assert reference.candidates == {2: 2, 4: 2}
  # Key 1 lost its count in that pruning: two more occurrences leave it a candidate.
  assert reference.candidates == {1: 2, 6: 1, 7: 1}


def test_key_in_the_current_step_is_never_evicted():
  id_map = _id_map(3, "lru", min_count=1)
  id_map.remap(tf.constant([10, 20], tf.int64), True)
  rows, fresh = id_map.remap(tf.constant([10, 20, 30], tf.int64), True)
  np.testing.assert_array_equal(rows.numpy(), [1, 2, 0])  # 30 waits at row 0: both rows in use
  assert fresh.numpy().size == 0


def test_inference_never_admits_or_counts():
  id_map = _id_map(4, "lfu", min_count=1)
  id_map.remap(tf.constant([5], tf.int64), True)
  before = [v.numpy().copy() for v in (id_map.counts, id_map.last_seen, id_map.step)]
  rows, fresh = id_map.remap(tf.constant([5, 6], tf.int64), False)
  np.testing.assert_array_equal(rows.numpy(), [1, 0])
  assert fresh.numpy().size == 0 and int(id_map.size()) == 1
  for old, variable in zip(before, (id_map.counts, id_map.last_seen, id_map.step)):
    np.testing.assert_array_equal(old, variable.numpy())


def test_lfu_counts_halve_every_half_life():
  id_map = _id_map(4, "lfu", min_count=1, half_life=2)
  id_map.remap(tf.constant([1, 1, 1, 1, 1, 1, 1, 1], tf.int64), True)  # step 1, epoch 0: 8
  id_map.remap(tf.constant([2], tf.int64), True)  # step 2, epoch 1
  id_map.remap(tf.constant([2], tf.int64), True)  # step 3, epoch 1
  id_map.remap(
    tf.constant([2], tf.int64), True
  )  # step 4, epoch 2: 8 >> 2 = 2 and (1 + 1) >> 1 + 1 = 2
  keys, rows, counts = id_map.export()
  assert list(keys.numpy()) == [1, 2] and list(counts.numpy()) == [2, 2]


@pytest.mark.parametrize("dtype", [tf.int32, tf.uint8, tf.int64])
def test_lookup_widens_narrower_integer_keys_as_the_layer_does(dtype):
  id_map, ref = IdMap(ManagedIds(), "items", 4), ReferenceMap(4)
  id_map.remap(tf.constant([7, 3], tf.int64), training=True)
  ref.train([7, 3])
  assert id_map.lookup(tf.constant([3, 7, 9], dtype)).numpy().tolist() == ref.lookup([3, 7, 9])


def test_lookup_refuses_keys_of_another_kind_naming_the_table():
  id_map = IdMap(ManagedIds(), "items", 4)
  with pytest.raises(ValueError, match="Table 'items' manages its ids with key_dtype int64.*got"):
    id_map.lookup(tf.constant(["a"]))


def test_string_key_map_holds_fingerprints_in_numeric_variables_and_looks_up_strings():
  """Every variable numeric (so every save format holds the map); `lookup` takes the strings,
  `export` gives the int64 fingerprints the map holds, as the reference computes them."""
  id_map, ref = _id_map(4, "lru", min_count=1, string=True), ReferenceMap(4, "lru")
  strings = [b"pear", b"", b"k\x00y", b"pear"]
  id_map.remap(as_keys(tf.constant(strings), tf.string, "t"), True)
  ref.train(fingerprints(strings))
  assert {v.dtype for v in id_map.variables} <= {tf.int32, tf.int64}
  assert id_map.keys.dtype == tf.int64
  assert [t.numpy().tolist() for t in id_map.export()] == [list(x) for x in ref.export()]
  probe = [b"k\x00y", b"pear", b"never", b""]
  assert id_map.lookup(tf.constant(probe)).numpy().tolist() == ref.lookup(fingerprints(probe))
  with pytest.raises(ValueError, match="Table 't' manages its ids with key_dtype string.*got"):
    id_map.lookup(tf.constant([1], tf.int64))


def test_capacity_below_two_is_refused_by_table():
  with pytest.raises(ValueError, match="Table 'tiny'.*vocabulary_size >= 2"):
    IdMap(ManagedIds(), "tiny", 1)


@pytest.mark.parametrize(
  "policy", POLICIES + [dict(eviction="lfu", half_life=1000, admission="always")], ids=_policy_id
)
def test_large_map_follows_reference(policy, engine_path):
  """A map larger than the compiled kernel's eviction pool (1024 rows at this capacity), full
  after a few steps, then evicting hundreds of rows a step: the pool is refilled, compacted and
  (LFU epochs) rebuilt many times; every step's rows equal the reference's."""
  capacity = 3000
  id_map = _id_map(capacity, min_count=1, **policy)
  reference = ReferenceMap(capacity, min_count=1, **policy)
  step = tf.function(id_map.remap, reduce_retracing=True)
  rng = np.random.default_rng(5)
  universe = rng.integers(-(2**62), 2**62, size=20_000)
  evicted = 0
  for s in range(40):
    keys = universe[(rng.zipf(1.2, size=700) + 400 * s) % len(universe)].tolist()
    rows, fresh = step(tf.constant(keys, tf.int64), True)
    expected_rows, expected_fresh = reference.train(keys)
    np.testing.assert_array_equal(rows.numpy(), expected_rows)
    np.testing.assert_array_equal(fresh.numpy(), expected_fresh)
    evicted += len(expected_fresh) if s > 10 else 0
  keys_, rows_, counts_ = id_map.export()
  assert keys_.numpy().tolist() == reference.export()[0]
  np.testing.assert_array_equal(counts_.numpy(), reference.export()[2])
  assert evicted > 2000  # many more victims than the pool holds


@pytest.mark.parametrize("policy", [POLICIES[0], POLICIES[-1]], ids=_policy_id)
def test_restore_at_the_same_step_reads_the_restored_map(tmp_path, policy):
  """A restore writes the map's variables behind the compiled kernel's eviction index, here
  with the very step count the map had: the next steps still follow the restored map (the
  policies' scores need no state beyond counts and last-seen steps)."""
  saved, id_map = _id_map(8, min_count=1, **policy), _id_map(8, min_count=1, **policy)
  reference = ReferenceMap(8, min_count=1, **policy)
  for s in range(6):
    keys = [10 * s + k for k in range(5)]
    saved.remap(tf.constant(keys, tf.int64), True)
    reference.train(keys)
    id_map.remap(tf.constant([-k - 100 * s for k in range(4)], tf.int64), True)
  path = tf.train.Checkpoint(m=saved).write(str(tmp_path / "ckpt"))
  tf.train.Checkpoint(m=id_map).read(path).assert_consumed()
  for s in range(6, 10):
    keys = [10 * s + k for k in range(5)] + [10 * (s - 1)]
    rows, fresh = id_map.remap(tf.constant(keys, tf.int64), True)
    expected_rows, expected_fresh = reference.train(keys)
    np.testing.assert_array_equal(rows.numpy(), expected_rows)
    np.testing.assert_array_equal(fresh.numpy(), expected_fresh)


def test_large_lfu_map_evicts_rows_seen_again_before_heavier_ones(engine_path):
  """The map first fills with keys seen 3 times; then each step brings 100 keys seen once and
  sees the previous step's ones again (count 2): those rows, lighter than the pool's heaviest
  row when it was built, must be evicted before the count-3 rows, as the reference says."""
  capacity = 3000
  id_map = _id_map(capacity, "lfu", min_count=1, admission="always")
  reference = ReferenceMap(capacity, "lfu", min_count=1, admission="always")
  step = tf.function(id_map.remap, reduce_retracing=True)
  singles = []
  for s in range(40):
    if s < 10:
      keys = [k for k in range(300 * s, 300 * s + 300) for _ in range(3)]
    else:
      keys = singles + [-k for k in range(100 * s, 100 * s + 100)]
      singles = keys[-100:]
    rows, fresh = step(tf.constant(keys, tf.int64), True)
    expected_rows, expected_fresh = reference.train(keys)
    np.testing.assert_array_equal(rows.numpy(), expected_rows)
    np.testing.assert_array_equal(fresh.numpy(), expected_fresh)
  assert sorted(set(reference.export()[2])) == [1, 2, 3]


def test_counts_saturate_at_int32_max(engine_path):
  id_map = _id_map(4, "lfu", min_count=1)
  id_map.remap(tf.constant([7], tf.int64), True)
  id_map.counts.scatter_update(tf.IndexedSlices(tf.constant([2**31 - 3], tf.int32), [1]))
  id_map.remap(tf.constant([7] * 5, tf.int64), True)
  assert id_map.export()[2].numpy().tolist() == [2**31 - 1]


def test_the_last_int32_step_is_refused_naming_the_table(engine_path):
  id_map = _id_map(4, "lru", min_count=1)
  id_map.remap(tf.constant([7], tf.int64), True)
  id_map.step.assign(2**31 - 2)
  id_map.remap(tf.constant([8], tf.int64), True)  # step 2**31 - 1: the last one
  before = [v.numpy().copy() for v in (id_map.counts, id_map.last_seen, id_map.step)]
  with pytest.raises(tf.errors.InvalidArgumentError, match="Table 't'.*2\\*\\*31 - 1 training"):
    id_map.remap(tf.constant([9], tf.int64), True)
  for old, variable in zip(before, (id_map.counts, id_map.last_seen, id_map.step)):
    np.testing.assert_array_equal(old, variable.numpy())
  assert id_map.export()[0].numpy().tolist() == [7, 8]


@pytest.mark.parametrize("counts", ["small", "huge", "negative"])
def test_map_with_a_pool_sorted_by_radix_follows_reference(counts, engine_path):
  """At 20 000 rows the compiled kernel's pool holds >= 4096 entries, which it sorts by radix on
  keys packed into 64 bits, or by comparison where (aged count, last_seen, row) need more bits
  ("huge": counts near 2**30 and last_seen over 2**21 steps) or a count is negative (only a
  write from outside leaves one). The map's variables are written directly (as a restore
  would), the reference given the same state; rows must agree."""
  capacity, half_life = 20_000, 2**30  # one LFU epoch: counts are not aged
  id_map = _id_map(capacity, "lfu", min_count=1, half_life=half_life, admission="always")
  reference = ReferenceMap(capacity, "lfu", min_count=1, half_life=half_life, admission="always")
  rng = np.random.default_rng(8)
  universe = rng.integers(-(2**62), 2**62, size=80_000)
  id_map.remap(tf.constant(universe[: capacity - 1]), True)
  reference.train(universe[: capacity - 1].tolist())
  rows = np.arange(1, capacity)
  base = {"small": 1, "huge": 2**30, "negative": -2}[counts]
  count_of = base + rng.integers(0, 5, size=capacity - 1)
  seen_at = rng.integers(0, 2**21, size=capacity - 1)
  id_map.counts.assign(np.concatenate([[0], count_of]).astype(np.int32))
  id_map.last_seen.assign(np.concatenate([[-1], seen_at]).astype(np.int32))
  id_map.step.assign(2**21)
  reference.step = 2**21
  for row, count, seen in zip(rows.tolist(), count_of.tolist(), seen_at.tolist()):
    reference.count[row], reference.last[row] = (count, 0), seen
  step = tf.function(id_map.remap, reduce_retracing=True)
  for s in range(4):
    old = universe[rng.integers(0, capacity - 1, size=1500)]
    new = universe[capacity + 4000 * s : capacity + 4000 * (s + 1)]
    keys = np.concatenate([old, new, new[:500]]).tolist()
    got, fresh = step(tf.constant(keys, tf.int64), True)
    expected_rows, expected_fresh = reference.train(keys)
    np.testing.assert_array_equal(got.numpy(), expected_rows)
    np.testing.assert_array_equal(fresh.numpy(), expected_fresh)
  keys_, _, counts_ = id_map.export()
  assert keys_.numpy().tolist() == reference.export()[0]
  np.testing.assert_array_equal(counts_.numpy(), reference.export()[2])


def test_competing_new_key_needs_a_higher_count_than_its_victim(engine_path):
  """LFU, two rows: key 2 (count 1) is the victim; a new key seen once ties with it and waits,
  one seen twice beats it; of two new keys the stronger meets the victim first; a key that
  lost keeps its count as a candidate and wins once its total beats the victim."""
  id_map = _id_map(3, "lfu", min_count=1, admission="compete")
  steps = ([1, 1, 1, 2], [3], [4, 4], [5, 6, 6, 6])
  expected = ([1, 1, 1, 2], [0], [2, 2], [0, 2, 2, 2])
  for keys, rows in zip(steps, expected):
    got, _ = id_map.remap(tf.constant(keys, tf.int64), True)
    assert got.numpy().tolist() == rows
  # Key 4 (count 2 at step 3) lost its row at step 4 to key 6 (3 > 2): 1 and 6 hold rows.
  assert id_map.export()[0].numpy().tolist() == [1, 6]
  keys, counts = id_map.candidates.export()
  assert dict(zip(keys.numpy().tolist(), counts.numpy().tolist())) == {3: 1, 5: 1}
  # Key 3: 1 + 1 = 2 against key 1's 3 (the weakest row: count 3, seen at step 1): waits;
  # then 2 + 2 = 4 > 3: it takes row 1.
  assert id_map.remap(tf.constant([3], tf.int64), True)[0].numpy().tolist() == [0]
  assert id_map.remap(tf.constant([3, 3], tf.int64), True)[0].numpy().tolist() == [1, 1]
  assert id_map.export()[2].numpy().tolist() == [4, 3]


def test_distance_lfu_score_is_count_over_distance(engine_path):
  """Key 2 (count 2) holds its row against new keys seen once while 2 / distance >= 1: at
  distances 1 and 2 (a tie keeps it), not at 3 (2 / 3); key 1 (count 4, 4 / 3) stays."""
  id_map = _id_map(3, "distance_lfu", min_count=1, admission="compete")
  id_map.remap(tf.constant([1, 1, 1, 1, 2, 2], tf.int64), True)  # step 1
  got = [int(id_map.remap(tf.constant([k], tf.int64), True)[0][0]) for k in (5, 6, 7)]
  assert got == [0, 0, 2]  # steps 2, 3, 4
  keys, rows, counts = id_map.export()
  assert keys.numpy().tolist() == [1, 7] and counts.numpy().tolist() == [4, 1]


def test_distance_lfu_without_competition_evicts_the_lowest_score(engine_path):
  """Scores at step 3: key 1 (count 4, seen at 1) 4 / 2 = 2; key 2 (count 3, seen at 2) 3 / 1
  = 3: key 1 goes, though its count is higher; decay 2 gives 4 / 4 = 1 against 3: the same."""
  for decay in (1.0, 2.0):
    id_map = _id_map(3, "distance_lfu", min_count=1, distance_decay=decay, admission="always")
    id_map.remap(tf.constant([1, 1, 1, 1], tf.int64), True)
    id_map.remap(tf.constant([2, 2, 2], tf.int64), True)
    rows, fresh = id_map.remap(tf.constant([9], tf.int64), True)
    assert rows.numpy().tolist() == [1] and fresh.numpy().tolist() == [1]


# ---------------------------------------------------------------------------------------------
# A map's two key -> row tables: the compiled kernel's own (TF's `MapTable` left empty) and TF's
# (filled, on TF's ops). A checkpoint of either kind, written eagerly or in a `tf.function`,
# restores into the other; a map stays on the kernels it was made on; the kernel's table follows
# assignments behind it, survives dense churn and refuses variables that give a key two rows.
# Rows against the plain-Python reference map or worked by hand.


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
