"""Tests of `tpu_embedding.engine.lookup`: the forward pass's explicit result, which the backward
pass receives, against NumPy on tables whose rows are their own ids."""

import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding.engine import inputs, lookup

E = tf.tpu.experimental.embedding
DIM = 2
VALUES = np.arange(8 * DIM, dtype=np.float32).reshape(8, DIM)  # W[r] = [2r, 2r + 1]


def _step():
  """Features a and c share table t (their ids deduplicated together); b reads table u."""
  t = E.TableConfig(8, DIM, name="t", combiner="sum")
  u = E.TableConfig(8, DIM, name="u", combiner="sum")
  config = config_lib.prepare(
    {"a": E.FeatureConfig(t), "b": E.FeatureConfig(u), "c": E.FeatureConfig(t)}, "sgd"
  )
  features = {
    "a": tf.constant([[5], [2], [5]], tf.int64),
    "b": tf.constant([[1], [1]], tf.int64),
    "c": tf.ragged.constant([[2, 7], [], [5]], tf.int64),
  }
  weights = {"a": None, "b": None, "c": tf.ragged.constant([[2.0, 3.0], [], [0.5]])}
  tables = {table: tf.Variable(VALUES) for table in config.tables}
  return inputs.Step.prepare(config, features, weights), tables


def test_training_returns_each_tables_deduplication_and_who_read_it(engine_path):
  step, tables = _step()
  with tf.GradientTape():  # the compiled kernels look up only under a recording tape
    forward = lookup.look_up(step, tables.__getitem__, lookup.deduplicated)
  a, b, c = (out.numpy() for out in forward.activations)
  np.testing.assert_array_equal(a, VALUES[[5, 2, 5]])
  np.testing.assert_array_equal(b, VALUES[[1, 1]])
  np.testing.assert_array_equal(c, [2 * VALUES[2] + 3 * VALUES[7], np.zeros(DIM), 0.5 * VALUES[5]])

  t = forward.tables[step.bags[0].feature.table]
  kernel = lookup.Kernel.COMPILED if engine_path == "native" else lookup.Kernel.TF_OPS
  assert t.kernel is kernel and [table.name for table in forward.tables] == ["t", "u"]
  assert len(t.bags) == 2
  np.testing.assert_array_equal(t.unique_ids.numpy(), [5, 2, 7])  # a's ids, then c's
  np.testing.assert_array_equal(t.index.numpy(), [0, 1, 0, 1, 2, 0])
  np.testing.assert_array_equal(t.occurrence_ids.numpy(), [5, 2, 5, 2, 7, 5])
  if kernel is lookup.Kernel.TF_OPS:  # the rows read, which the update may reuse
    np.testing.assert_array_equal(t.looked_up_rows.numpy(), VALUES[[5, 2, 7]])
  else:
    assert t.looked_up_rows is None


def test_the_backward_assembles_row_gradients_from_the_forward_result(engine_path):
  step, tables = _step()
  with tf.GradientTape():
    forward = lookup.look_up(step, tables.__getitem__, lookup.deduplicated)
  upstream = [
    np.array([[1, 2], [3, 4], [5, 6]], np.float32),
    np.array([[1, 1], [2, 2]], np.float32),
    np.array([[10, 20], [30, 40], [50, 60]], np.float32),
  ]
  (t, found_t, up_t), (u, found_u, up_u) = forward.upstream_by_table(upstream)
  assert (t.name, u.name) == ("t", "u")
  assert len(up_t) == 2 and up_t[0] is upstream[0] and up_t[1] is upstream[2]
  assert len(up_u) == 1 and up_u[0] is upstream[1]
  # Rows 5, 2, 7 of t: a's samples 0 and 2 and c's third sample at gain 0.5 reach row 5; a's
  # sample 1 and c's first at gain 2 reach row 2; c's first at gain 3 reaches row 7.
  want = [
    upstream[0][0] + upstream[0][2] + 0.5 * upstream[2][2],
    upstream[0][1] + 2 * upstream[2][0],
    3 * upstream[2][0],
  ]
  np.testing.assert_allclose(found_t.row_gradients(up_t, DIM).numpy(), want)
  np.testing.assert_allclose(found_u.row_gradients(up_u, DIM).numpy(), [[3, 3]])
  occurrences = found_t.occurrence_gradients([None, up_t[1]], DIM).numpy()
  np.testing.assert_allclose(
    occurrences, [[0, 0]] * 3 + [2 * upstream[2][0], 3 * upstream[2][0], 0.5 * upstream[2][2]]
  )


@pytest.mark.parametrize("dim", [2, 40])  # 40: one id per sample, wide rows take a gather
def test_inference_gives_the_training_activations_without_deduplicating(dim):
  step, _ = _step()
  values = np.arange(8 * dim, dtype=np.float32).reshape(8, dim)
  variables = {table: tf.Variable(values) for table in step.tables}
  read = variables.__getitem__
  inference = lookup.look_up(step, read, lookup.per_occurrence)
  training = lookup.look_up(step, read, lookup.deduplicated)
  for got, want in zip(inference.activations, training.activations):
    np.testing.assert_array_equal(got.numpy(), want.numpy())
  np.testing.assert_array_equal(inference.activations[0].numpy(), values[[5, 2, 5]])
  for found in inference.tables.values():
    assert found.kernel is lookup.Kernel.PER_OCCURRENCE and found.unique_ids is None
