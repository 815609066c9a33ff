"""Tests of `tpu_embedding.preflight.routing` on the host side, by hand: each input kind read as
ids with their samples, a sample's repeated ids once, each id's column and block in its stack
(the module docstring's rule, worked out here), the order TF's kernels pack ids in, and the chip
counts TF refuses. The whole layout against TF's: tests/preflight/test_input_stats.py."""

import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding.preflight import routing

# 2 chips x 2 SparseCores: N = 4 partitions. Table "t" (10 rows) sits in stack "s" at row offset
# 2 (col_offset = N * 2) with shard rotation 1; 2 samples per chip, so one per SparseCore.
ROUTE = routing.FeatureRoute("f", "t", "s", 10, col_offset=8, col_shift=1, samples_per_chip=2)
ROUTING = routing.Routing(2, 2, (ROUTE,), {"s": ("t",)}, {"s": 2})


@pytest.mark.parametrize(
  "value, ids, samples, rows",
  [
    (tf.constant([[3], [5]]), [3, 5], [0, 1], 2),  # dense: one id a sample, flattened
    (tf.ragged.constant([[1, 2], [], [3]]), [1, 2, 3], [0, 0, 2], 3),
    (tf.SparseTensor([[0, 0], [0, 1], [2, 0]], [4, 5, 6], [3, 2]), [4, 5, 6], [0, 0, 2], 3),
  ],
  ids=["dense", "ragged", "sparse"],
)
def test_each_input_kind_is_read_as_ids_with_their_samples(value, ids, samples, rows):
  read = routing.host_rows(value, "f")
  assert (read.ids.tolist(), read.samples.tolist(), read.rows) == (ids, samples, rows)
  assert routing.sample_count(value) == rows


def test_a_samples_repeated_ids_count_once():
  samples, ids = routing.samples_and_ids(
    tf.ragged.constant([[7, 7, 2], [], [7], [1, 1]]), ROUTE, num_chips=2
  )
  assert (samples.tolist(), ids.tolist()) == ([0, 0, 2, 3], [2, 7, 7, 1])


@pytest.mark.parametrize(
  "value, message",
  [
    (tf.ragged.constant([[10], [], [], []]), r"Feature 'f': id 10 is outside table 't'"),
    (tf.ragged.constant([[1], []]), r"Feature 'f': the batch has 2 samples; .* say 4 \(2 per"),
    (tf.SparseTensor([[1, 0], [0, 0]], [1, 2], [4, 1]), "not in row order"),
  ],
)
def test_ids_tf_would_refuse_are_refused_by_feature(value, message):
  with pytest.raises(ValueError, match=message):
    routing.samples_and_ids(value, ROUTE, num_chips=2)


def test_each_id_goes_to_its_column_and_to_its_samples_sparse_core():
  # column = ((id + 1) & 3) + (id & ~3) + 8: id 0 -> 1 + 0 + 8 = 9, id 3 -> 0 + 0 + 8 = 8,
  # id 5 -> 2 + 4 + 8 = 14, id 9 -> 2 + 8 + 8 = 18.
  (entries,) = routing.stack_entries(ROUTING, [tf.constant([0, 3, 5, 9])]).values()
  assert entries.column.tolist() == [9, 8, 14, 18]
  assert entries.partition.tolist() == [1, 0, 2, 2]
  assert entries.block.tolist() == [0, 1, 2, 3]  # sample s on chip s // 2, SparseCore s % 2


@pytest.mark.parametrize("big_sample", [5, 2**60], ids=["one_key", "lexsort"])
def test_ids_are_packed_by_block_partition_column_feature_then_sample(big_sample):
  # (block, column, feature, sample, id); N = 4, so a column's partition is its low 2 bits.
  rows = [
    (1, 5, 0, 3, 50),  # block 1 comes last
    (0, 6, 0, 1, 60),  # partition 2
    (0, 9, 1, big_sample, 90),  # partition 1, column 9, feature 1
    (0, 9, 0, 2, 91),  # partition 1, column 9, feature 0
    (0, 5, 0, 0, 92),  # partition 1, column 5
    (0, 4, 0, 4, 40),  # partition 0
  ]
  pieces = [tuple(np.array(field, np.int64) for field in zip(*rows))]
  packed = routing.in_packing_order(routing.StackEntries(pieces, 4), 4)
  assert packed.id.tolist() == [40, 92, 91, 90, 60, 50]


@pytest.mark.parametrize(
  "chips, cores, message",
  [
    (0, 2, "num_chips must be a whole number >= 1; got 0"),
    (2.0, 2, "num_chips must be a whole number >= 1; got 2.0"),
    (True, 2, "num_chips must be a whole number >= 1; got True"),
    (3, 2, r"num_chips \* sparse_cores_per_chip = 3 \* 2 = 6 is not a power of two"),
  ],
)
def test_chip_counts_tf_refuses_are_refused(chips, cores, message):
  with pytest.raises(ValueError, match=message):
    routing.validate_chips(chips, cores)
  routing.validate_chips(4, 2)  # 8 partitions
