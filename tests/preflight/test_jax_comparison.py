"""`preflight.sparse_core_stats` against jax-tpu-embedding's host preprocessing (run in its own
environment: `make jax-env`, or JAX_TPU_EMBEDDING_PYTHON), on the same batches: the same maxima
wherever the two read the input alike, and each place they do not, named.

Tables unstacked in both (TF with stacking disabled lays each table out with rotation 0, as
jax-tpu-embedding does for a table it did not stack); one child process per configuration."""

import numpy as np
import pytest
import tensorflow as tf

from benchmarks import jax_sparse_core
from tpu_embedding import preflight, tf_internals

emb = tf.tpu.experimental.embedding
pytestmark = [
  pytest.mark.integration,
  pytest.mark.skipif(
    tf_internals.SPARSE_CORE_CONFIG is None, reason=f"no SparseCore limits on TF {tf.__version__}"
  ),
  pytest.mark.skipif(
    jax_sparse_core.jax_python() is None,
    reason="no jax-tpu-embedding environment (make jax-env, or set JAX_TPU_EMBEDDING_PYTHON)",
  ),
]
TABLES = {"video": 1000, "user": 300}
FEATURES = {"clicked": "video", "watched": "video", "user": "user"}


def _config():
  tables = {name: emb.TableConfig(size, 8, name=name) for name, size in TABLES.items()}
  return {feature: emb.FeatureConfig(tables[table]) for feature, table in FEATURES.items()}


def _zipf_batches(chips, seed, count=3):
  """{feature: (values, row lengths)}: one-hot "clicked" and "user", multi-hot "watched"."""
  rng = np.random.default_rng(seed)
  rows = 16 * chips
  batches = []
  for _ in range(count):
    batch = {}
    for feature, table in FEATURES.items():
      lengths = rng.integers(0, 6, rows) if feature == "watched" else np.ones(rows, np.int64)
      values = np.minimum(rng.zipf(1.2, int(lengths.sum())) - 1, TABLES[table] - 1)
      batch[feature] = (values, lengths)
    batches.append(batch)
  return batches


def _ragged(batch):
  return {f: tf.RaggedTensor.from_row_lengths(v, lengths) for f, (v, lengths) in batch.items()}


def _tables_only(stats):
  return {k: v for k, v in stats.items() if k != "max_ids_per_chip_per_sample"}


@pytest.mark.parametrize("chips", [1, 8, 64])
def test_the_same_maxima_on_ragged_and_one_hot_batches(chips):
  batches = _zipf_batches(chips, seed=chips)
  jax = jax_sparse_core.run(batches, TABLES, FEATURES, num_chips=chips, sparse_cores_per_chip=4)
  ours = preflight.sparse_core_stats(
    _config(), [_ragged(b) for b in batches], num_chips=chips, stacking=False
  )
  want = {
    name: {k: v for k, v in counts.items() if k != "dropped"}
    for name, counts in jax["tables"].items()
  }
  assert _tables_only(ours) == want


def test_difference_a_dense_2d_batch_is_one_sample_per_element_for_tf():
  """[8, 2] ids, all 0, one chip: TF reads 16 samples (4 per SparseCore, each sending id 0 to
  partition 0: 4 ids), jax-tpu-embedding 8 samples of 2 ids (2 per SparseCore; a sample's
  repeated id counts once: 2 ids). Fed one id a row, jax-tpu-embedding agrees with TF."""
  dense = np.zeros((8, 2), np.int64)
  config = {"user": emb.FeatureConfig(emb.TableConfig(300, 8, name="user"))}
  ours = preflight.sparse_core_stats(config, [{"user": dense}], num_chips=1, stacking=False)
  assert ours["user"] == {"max_ids_per_partition": 4, "max_unique_ids_per_partition": 1}
  as_rows = {"user": (dense.reshape(-1), np.full(8, 2))}
  as_elements = {"user": (dense.reshape(-1), np.ones(16, np.int64))}
  jax_rows, jax_elements = (
    jax_sparse_core.run([b], {"user": 300}, {"user": "user"}, num_chips=1, sparse_cores_per_chip=4)
    for b in (as_rows, as_elements)
  )
  assert jax_rows["tables"]["user"]["max_ids_per_partition"] == 2
  assert jax_elements["tables"]["user"]["max_ids_per_partition"] == 4


def test_difference_jax_drops_past_a_partition_limit_where_tf_fails_the_step():
  """A limit of 2 ids per partition: with allow_id_dropping jax-tpu-embedding drops the excess
  and carries on; TF's kernel fails the step with or without it (preview_limits says which)."""
  batches = _zipf_batches(2, seed=5, count=1)
  jax = jax_sparse_core.run(
    batches, TABLES, FEATURES, num_chips=2, sparse_cores_per_chip=4, limit=2,
    allow_id_dropping=True,
  )  # fmt: skip
  assert jax["tables"]["video"]["dropped"] > 0
  limits = emb.SparseCoreEmbeddingConfig(
    disable_table_stacking=True,
    max_ids_per_table=dict.fromkeys(TABLES, 2),
    max_unique_ids_per_table=dict.fromkeys(TABLES, 2),
    allow_id_dropping=True,
  )
  preview = preflight.preview_limits(_config(), [_ragged(b) for b in batches], limits, num_chips=2)
  assert preview.failed_batches == [0]
  assert {f.table for f in preview.failures} >= {"video"}
