"""`tpu_embedding.preflight.sparse_core_stats` against a brute-force reading of TF's SparseCore
routing (tests/support/sparse_core_reference.py) on random Zipf batches, and by hand."""

import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding import preflight, tf_internals

import sparse_core_reference

emb = tf.tpu.experimental.embedding
pytestmark = pytest.mark.skipif(
  tf_internals.SPARSE_CORE_CONFIG is None, reason=f"no SparseCore limits on TF {tf.__version__}"
)


def _tables():
  return {
    "video": emb.TableConfig(1000, 8, name="video"),
    "user": emb.TableConfig(300, 4, name="user"),
    "genre": emb.TableConfig(40, 8, name="genre", optimizer=emb.SGD(0.1)),
  }


def _zipf(rng, size, vocabulary):
  return np.minimum(rng.zipf(1.3, size) - 1, vocabulary - 1).astype(np.int64)


def _ragged(rng, rows, vocabulary, most):
  lengths = rng.integers(0, most + 1, rows)
  return tf.RaggedTensor.from_row_lengths(_zipf(rng, int(lengths.sum()), vocabulary), lengths)


def _sparse(rng, rows, vocabulary, most):
  ragged = _ragged(rng, rows, vocabulary, most)
  return ragged.to_sparse()


def _config(tables):
  return {
    "clicked": emb.FeatureConfig(tables["video"]),  # dense one-hot
    "watched": emb.FeatureConfig(tables["video"]),  # ragged multi-hot, shares the table
    "user": emb.FeatureConfig(tables["user"]),  # dense [B, 2]: 2 samples per row
    "genres": emb.FeatureConfig(tables["genre"]),  # sparse
  }


def _batches(seed, chips, count=3):
  rng = np.random.default_rng(seed)
  rows = chips * 8
  for _ in range(count):
    yield {
      "clicked": tf.constant(_zipf(rng, rows, 1000)),
      "watched": _ragged(rng, rows, 1000, 6),
      "user": _zipf(rng, (rows, 2), 300),
      "genres": _sparse(rng, rows, 40, 3),
    }


@pytest.mark.parametrize("chips", [1, 2, 4, 16, 64])
@pytest.mark.parametrize("stacking", [True, False], ids=["stacked", "unstacked"])
def test_random_zipf_batches_match_the_reference(chips, stacking):
  config = _config(_tables())
  want = sparse_core_reference.stats(config, _batches(chips, chips), chips, stacking=stacking)
  got = preflight.sparse_core_stats(
    config, _batches(chips, chips), num_chips=chips, stacking=stacking
  )
  assert got == want
  stacks = set(got) - {"max_ids_per_chip_per_sample"}
  assert stacks == ({"user_video", "genre"} if stacking else {"video", "user", "genre"})


def test_two_sparse_cores_per_chip_match_the_reference():
  config = _config(_tables())
  want = sparse_core_reference.stats(config, _batches(7, 4), 4, cores=2)
  assert (
    preflight.sparse_core_stats(config, _batches(7, 4), num_chips=4, sparse_cores_per_chip=2)
    == want
  )


def test_worked_by_hand():
  """One chip, 4 SparseCores (4 partitions), 2 samples per SparseCore, rotation 0: SparseCore 0
  sends ids 0 and 4 to partition 0; 1 sends id 1 twice (two samples: 2 ids, 1 unique) to
  partition 1; 2 sends 2 and 3 to partitions 2 and 3; 3 sends 8 and 12 to partition 0. The
  per-chip buffer packs runs 2 | 2 | 1, 1 | 2, each padded to 8: the last run ends at
  8 + 8 + 16 + 2 = 34 ids, so 34 / 8 samples -> 5 per sample (5 * 8 = 40, a multiple of 8)."""
  table = emb.TableConfig(64, 4, name="t")
  config = {"f": emb.FeatureConfig(table)}
  layout = sparse_core_reference.layouts(config, 1, 4, True, {"f": 8})["t"]
  assert layout.sparse_core_shard_rotation == 0
  batch = {"f": np.array([0, 4, 1, 1, 2, 3, 8, 12])}
  assert preflight.sparse_core_stats(config, [batch], num_chips=1) == {
    "t": {"max_ids_per_partition": 2, "max_unique_ids_per_partition": 2},
    "max_ids_per_chip_per_sample": 5,
  }


def test_a_samples_repeated_id_counts_once_in_any_order():
  """[5, 3, 5] is two ids for TF (it sums the repeated id's weights), as is [5, 5, 3]."""
  table = emb.TableConfig(64, 4, name="t")
  config = {"f": emb.FeatureConfig(table)}
  rows = [[5, 3, 5], [], [], []]
  got = preflight.sparse_core_stats(
    config, [{"f": tf.ragged.constant(rows, tf.int64)}], num_chips=1
  )
  # Ids 5 and 3 go to partitions 1 and 3 from SparseCore 0: one id each.
  assert got["t"] == {"max_ids_per_partition": 1, "max_unique_ids_per_partition": 1}


def test_a_one_pass_generator_is_read_once():
  config = _config(_tables())
  want = sparse_core_reference.stats(config, _batches(3, 2), 2)
  assert preflight.sparse_core_stats(config, _batches(3, 2), num_chips=2) == want


def test_output_shape_is_per_chip():
  """A feature's output_shape is its samples per chip: 16 global samples on 2 chips."""
  table = emb.TableConfig(64, 4, name="t")
  batch = {"f": np.arange(16)}
  shaped = {"f": emb.FeatureConfig(table, output_shape=[8])}
  unshaped = {"f": emb.FeatureConfig(table)}
  assert preflight.sparse_core_stats(shaped, [batch], num_chips=2) == preflight.sparse_core_stats(
    unshaped, [batch], num_chips=2
  )
  with pytest.raises(ValueError, match=r"'f'.*16 samples.*32 \(16 per chip on 2 chips\)"):
    preflight.sparse_core_stats(
      {"f": emb.FeatureConfig(table, output_shape=[16])}, [batch], num_chips=2
    )


def _small():
  table = emb.TableConfig(64, 4, name="t")
  return {"f": emb.FeatureConfig(table)}, {"f": np.arange(8)}


@pytest.mark.parametrize(
  "kwargs,message",
  [
    ({"num_chips": 0}, "num_chips must be a whole number >= 1; got 0"),
    ({"num_chips": 2.0}, "num_chips must be a whole number >= 1; got 2.0"),
    ({"num_chips": 3}, r"3 \* 4 = 12 is not a power of two"),
    ({"num_chips": 1, "sparse_cores_per_chip": 0}, "sparse_cores_per_chip must be"),
    ({"num_chips": 1, "sparse_cores_per_chip": 3}, r"1 \* 3 = 3 is not a power of two"),
  ],
)
def test_chip_counts_tf_refuses_are_refused(kwargs, message):
  config, batch = _small()
  with pytest.raises(ValueError, match=message):
    preflight.sparse_core_stats(config, [batch], **kwargs)


@pytest.mark.parametrize(
  "batch,message",
  [
    ({"g": np.arange(8)}, r"missing \['f'\], not configured \['g'\]"),
    ({"f": np.arange(8), "g": np.arange(8)}, r"not configured \['g'\]"),
    ({"f": np.arange(6)}, r"'f'.*6 samples per chip do not split evenly over 4 SparseCores"),
    ({"f": np.array([0, 1, 2, 3, 4, 5, 6, 64])}, r"'f': id 64 is outside table 't' \(vocab"),
    ({"f": np.array([0, 1, 2, 3, 4, 5, 6, -1])}, r"'f': id -1 is outside"),
    ({"f": np.arange(8.0)}, r"'f': ids must be integers; got float64"),
    (
      {"f": tf.SparseTensor([[1, 0], [0, 0]], tf.constant([1, 2], tf.int64), [8, 1])},
      r"'f'.*not in row order",
    ),
    ([np.arange(8)], "dict of features"),
  ],
)
def test_batches_that_do_not_match_the_config_are_refused(batch, message):
  config, _ = _small()
  with pytest.raises(ValueError, match=message):
    preflight.sparse_core_stats(config, [batch], num_chips=1)


def test_a_later_batch_of_another_size_is_refused():
  config, batch = _small()
  with pytest.raises(ValueError, match=r"'f': the batch has 16 samples.*say 8"):
    preflight.sparse_core_stats(config, [batch, {"f": np.arange(16)}], num_chips=1)


def test_no_batches_is_refused():
  config, _ = _small()
  with pytest.raises(ValueError, match="batches is empty"):
    preflight.sparse_core_stats(config, iter([]), num_chips=1)


def test_the_users_config_is_left_as_it_was():
  """TF's stacker pads the tables it is given; it is given clones."""
  config, batch = _small()
  preflight.sparse_core_stats(config, [batch], num_chips=1)
  table = config["f"].table
  assert (table.vocabulary_size, table.dim, table.optimizer) == (64, 4, None)
  assert config["f"].output_shape.rank is None
