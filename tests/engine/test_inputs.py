"""Tests of `tpu_embedding.engine.inputs`: ids and weights converted into bags, whatever the
trace knows of their shape. Expected activations come from NumPy on a table whose rows are their
own ids.
"""

import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding.engine import inputs

from input_layers import DIM, VALUES, E, layer, train_step, weights_cases

# ---------------------------------------------------------------------------------------------
# The same input gives the same answer whatever the trace knows of its shape


def test_dense_b_by_1_ids_give_b_by_d_under_an_unknown_last_dimension():
  model = layer()
  lookup = tf.function(
    lambda ids: model({"f": ids})["f"], input_signature=[tf.TensorSpec([None, None], tf.int64)]
  )
  out = lookup(tf.constant([[1], [2], [7]], tf.int64))
  np.testing.assert_array_equal(out.numpy(), VALUES[[1, 2, 7]])
  wide = lookup(tf.constant([[1, 2], [3, 4]], tf.int64))  # [B, n]: each id its own sample
  np.testing.assert_array_equal(wide.numpy(), VALUES[[[1, 2], [3, 4]]])


def test_a_sequence_feature_with_an_unknown_last_dimension_is_refused():
  model = layer(max_sequence_length=3)
  lookup = tf.function(
    lambda ids: model({"f": ids})["f"], input_signature=[tf.TensorSpec([None, None], tf.int64)]
  )
  with pytest.raises(ValueError, match="'f' is a sequence feature.*known last dimension"):
    lookup(tf.constant([[1], [2]], tf.int64))


@pytest.mark.parametrize("rank", [1, 2])
def test_sparse_ids_of_unknown_rank_give_the_same_bags(rank):
  model = layer()
  if rank == 1:  # [3] with ids at positions 0 and 2: three samples, the middle one empty
    sp = tf.SparseTensor([[0], [2]], tf.constant([1, 4], tf.int64), [3])
    expected = np.stack([VALUES[1], np.zeros(DIM), VALUES[4]])
  else:
    sp = tf.SparseTensor([[0, 0], [0, 1], [2, 0]], tf.constant([1, 3, 4], tf.int64), [3, 2])
    expected = np.stack([VALUES[1] + VALUES[3], np.zeros(DIM), VALUES[4]])
  lookup = tf.function(
    lambda s: model({"f": s})["f"], input_signature=[tf.SparseTensorSpec(None, tf.int64)]
  )
  np.testing.assert_array_equal(lookup(sp).numpy(), expected)
  np.testing.assert_array_equal(model({"f": sp})["f"].numpy(), expected)


def test_every_input_kind_gives_a_sequence_feature_the_same_b_by_l_positions():
  """L = 3: longer sequences are truncated, shorter ones padded with zero rows."""
  model = layer(max_sequence_length=3)
  long = [[1, 3, 2, 4], [4, 5, 6, 7]]
  want = VALUES[[[1, 3, 2], [4, 5, 6]]]
  for ids in (
    tf.constant(long, tf.int64),
    tf.ragged.constant(long, tf.int64),
    tf.sparse.from_dense(tf.constant(long, tf.int64)),  # no id is 0, so every position stays
  ):
    np.testing.assert_array_equal(model({"f": ids})["f"].numpy(), want)
  short = model({"f": tf.constant([[1, 3], [4, 5]], tf.int64)})["f"].numpy()
  np.testing.assert_array_equal(short, np.concatenate([want[:, :2], np.zeros([2, 1, DIM])], 1))


@pytest.mark.parametrize("kind", ["sparse", "ragged"])
def test_a_sequence_feature_refuses_weights_naming_the_feature(kind):
  ids, _ = weights_cases()[kind]
  weights = tf.cast(ids, tf.float32)  # laid out as the ids
  with pytest.raises(ValueError, match="'f' is a sequence feature.*weights are not allowed"):
    layer(max_sequence_length=3)({"f": ids}, weights={"f": weights})


# ---------------------------------------------------------------------------------------------
# The conversion, checks included, compiles with XLA (for the engine's compiled step)


def test_input_conversion_with_its_checks_compiles_with_xla():
  config = config_lib.prepare(
    {"f": E.FeatureConfig(E.TableConfig(10, DIM, name="t", combiner="mean"))}, "sgd"
  )
  feature = config.features[0]

  @tf.function(jit_compile=True)
  def bags(indices, ids, weights, ragged_ids, ragged_weights):
    sparse = inputs.to_bags(
      feature, tf.SparseTensor(indices, ids, [2, 2]), tf.SparseTensor(indices, weights, [2, 2])
    )
    ragged = inputs.to_bags(feature, ragged_ids, ragged_weights)
    return sparse.samples, sparse.gains, ragged.samples, ragged.gains

  out = bags(
    tf.constant([[0, 0], [0, 1], [1, 0]], tf.int64),
    tf.constant([1, 3, 4], tf.int64),
    tf.constant([1.0, 3.0, 2.0]),
    tf.ragged.constant([[1, 3], [4]], tf.int64),
    tf.ragged.constant([[1.0, 3.0], [2.0]]),
  )
  gains = [0.25, 0.75, 1.0]  # mean: each weight over its bag's weight sum (4, then 2)
  for samples, sample_gains in (out[:2], out[2:]):
    np.testing.assert_array_equal(samples.numpy(), [0, 0, 1])
    np.testing.assert_allclose(sample_gains.numpy(), gains)


# ---------------------------------------------------------------------------------------------
# Inputs that were once dropped or misread without a word


@pytest.mark.parametrize("combiner", ["sum", "mean"])
@pytest.mark.parametrize(
  "signature",
  [None, tf.RaggedTensorSpec([2, None], tf.int64), tf.RaggedTensorSpec([None, None], tf.int64)],
)
def test_a_ragged_output_shape_gives_the_same_result_whatever_the_trace_knows_of_the_batch(
  combiner, signature
):
  ids = tf.ragged.constant([[1, 2, 7], [0]], tf.int64)
  run = lambda model: train_step(model, {"f": ids}, None if signature is None else {"f": signature})
  # [2, 2]: two positions per row (7 past them); [2]: each row combined.
  sequence = run(layer(combiner, output_shape=[2, 2]))["f"].numpy()
  np.testing.assert_array_equal(sequence, VALUES[[[1, 2], [0, 0]]] * [[[1], [1]], [[1], [0]]])
  combined = run(layer(combiner, output_shape=[2]))["f"].numpy()
  scale = 1 / 3 if combiner == "mean" else 1
  np.testing.assert_allclose(combined, [VALUES[[1, 2, 7]].sum(0) * scale, VALUES[0]], rtol=1e-6)
  with pytest.raises(
    tf.errors.InvalidArgumentError
    if signature is not None and signature.shape[0] is None
    else ValueError,
    match=r"(?s)Feature \\?'f\\?'.*output_shape (\(3,\)|\[3\]) holds 3 samples",
  ):
    run(layer(combiner, output_shape=[3]))
