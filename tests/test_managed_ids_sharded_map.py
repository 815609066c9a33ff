"""`ShardedIdMap`'s layout and refusals, without a cluster (the cluster tests are in
`test_managed_ids_sharded.py`)."""

import pytest

import tpu_embedding
from tpu_embedding.managed_ids import sharded_map


def test_rows_are_cut_in_contiguous_ranges_the_first_ones_longer():
  assert sharded_map.row_ranges(13, 2) == [(1, 7), (7, 13)]
  assert sharded_map.row_ranges(8, 3) == [(1, 4), (4, 6), (6, 8)]
  assert sharded_map.row_ranges(3, 2) == [(1, 2), (2, 3)]


def test_a_table_with_fewer_key_rows_than_shards_is_refused_naming_it():
  with pytest.raises(ValueError, match=r"Table 'movies'.*2 parameter servers.*>= 3; got 2"):
    sharded_map.ShardedIdMap(tpu_embedding.ManagedIds(), "movies", 2, 2)
