"""`IdMap` against the plain-Python reference map, step by step, eager and in tf.function."""

import numpy as np
import pytest
import tensorflow as tf

from tests.managed_ids_reference import ReferenceMap
from tpu_embedding.managed_ids import IdMap, ManagedIds

POLICIES = [
  dict(eviction="lfu", half_life=3),
  dict(eviction="lru"),
  dict(eviction="ttl", ttl_steps=2),
]


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


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p["eviction"])
@pytest.mark.parametrize("min_count", [1, 3])
@pytest.mark.parametrize("string", [False, True])
@pytest.mark.parametrize("traced", [False, True])
def test_map_follows_reference(policy, min_count, string, traced, engine_path):
  """On both paths (the engine's compiled kernel choosing rows, and TF ops alone)."""
  id_map = _id_map(6, min_count=min_count, string=string, **policy)
  reference = ReferenceMap(6, min_count=min_count, **policy)
  step = id_map.remap
  if traced:
    step = tf.function(id_map.remap, reduce_retracing=True)
    graph = step.get_concrete_function(tf.TensorSpec([None], id_map.key_dtype), True).graph
    ops = {op.type for op in graph.get_operations()}
    assert ("TpuEmbeddingManagedRowsToGive" in ops) == (engine_path == "native")
  admitted = 0
  for keys in _stream(seed=min_count + 10 * string, steps=30, string=string):
    rows, fresh = step(tf.constant(keys), True)
    expected_rows, expected_fresh = reference.train(keys)
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


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(eviction="random"), "unknown eviction policy"),
    (dict(min_count=0), "min_count=0"),
    (dict(key_dtype=tf.float32), "key_dtype"),
    (dict(eviction="ttl"), "ttl_steps=None"),
    (dict(ttl_steps=3), "only used with eviction='ttl'"),
    (dict(reset_every_steps=0), r"reset_every_steps=0\): expected an int >= 1"),
  ],
)
def test_bad_specs_are_refused(kwargs, message):
  with pytest.raises(ValueError, match=message):
    ManagedIds(**kwargs)


def test_capacity_below_two_is_refused_by_table():
  with pytest.raises(ValueError, match="Table 'tiny'.*vocabulary_size >= 2"):
    IdMap(ManagedIds(), "tiny", 1)
