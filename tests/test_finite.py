"""Tests of `tpu_embedding.engine.finite`: TPUEmbedding(check_finite=True) stops NaN/Inf before a
table; by default they poison the touched rows, as on TPU. Both engine paths (compiled kernels and
TF ops) must agree on what they accept.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tpu_embedding
from tpu_embedding import backends
from tpu_embedding import config as config_lib
from tpu_embedding import hardware

E = tf.tpu.experimental.embedding
ROWS = np.arange(10, dtype=np.float32).reshape(5, 2)


def layer(learning_rate=0.5, **kwargs):
  table = E.TableConfig(
    5, 2, name="videos", combiner="sum", initializer=tf.constant_initializer(ROWS)
  )
  return tpu_embedding.TPUEmbedding(
    {"watched": E.FeatureConfig(table)}, E.SGD(learning_rate=learning_rate), **kwargs
  )


def train(model, scale=1.0, weights=None, traced=False):
  ids = tf.SparseTensor([[0, 0], [1, 0]], tf.constant([1, 3], tf.int64), [2, 1])

  def step():
    with tf.GradientTape() as tape:
      out = model({"watched": ids}, weights=weights)["watched"]
      loss = tf.reduce_sum(out) * scale
    tape.gradient(loss, model.trainable_variables)

  (tf.function(step) if traced else step)()


def table_of(model):
  return model.variables_by_table["videos"]["parameters"].numpy()


def test_by_default_a_nan_gradient_poisons_the_touched_rows_as_on_tpu(engine_path):
  model = layer()
  train(model, scale=float("nan"))
  values = table_of(model)
  assert np.isnan(values[[1, 3]]).all()
  np.testing.assert_array_equal(values[[0, 2, 4]], ROWS[[0, 2, 4]])


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("table_updates", ["engine", "keras"])
def test_a_non_finite_gradient_is_refused_naming_feature_and_table(
  engine_path, traced, table_updates
):
  model = layer(check_finite=True, table_updates=table_updates)
  with pytest.raises(
    tf.errors.InvalidArgumentError,
    match="Feature 'watched' \\(table 'videos'\\): the gradient of its "
    "activations holds a non-finite value",
  ):
    train(model, scale=float("inf"), traced=traced)
  np.testing.assert_array_equal(table_of(model), ROWS)
  train(model)  # finite values still train: d(sum)/d(row) = 1, learning rate 0.5 on the engine
  expected = ROWS.copy()
  if table_updates == "engine":
    expected[[1, 3]] -= 0.5
  np.testing.assert_array_equal(table_of(model), expected)


def test_a_non_finite_weight_is_refused_naming_the_feature(engine_path):
  model = layer(check_finite=True)
  weights = {"watched": tf.SparseTensor([[0, 0], [1, 0]], [1.0, float("nan")], [2, 1])}
  with pytest.raises(
    tf.errors.InvalidArgumentError,
    match="Feature 'watched' \\(table 'videos'\\): its weights hold a non-finite value",
  ):
    train(model, weights=weights)
  np.testing.assert_array_equal(table_of(model), ROWS)


@pytest.mark.parametrize("traced", [False, True])
def test_a_non_finite_learning_rate_is_refused_naming_the_table(engine_path, traced):
  model = layer(learning_rate=lambda: float("nan"), check_finite=True)
  with pytest.raises(
    tf.errors.InvalidArgumentError, match="Table 'videos': its learning rate is not finite"
  ):
    train(model, traced=traced)
  np.testing.assert_array_equal(table_of(model), ROWS)


@pytest.mark.parametrize("rate", [lambda: tf.constant([0.1, 0.2]), lambda: "0.1"])
def test_both_engine_paths_refuse_a_learning_rate_that_is_not_a_scalar(engine_path, rate):
  model = layer(learning_rate=rate)
  with pytest.raises(
    TypeError, match="Table 'videos': its learning_rate callable returned .*expected a scalar float"
  ):
    train(model)
  np.testing.assert_array_equal(table_of(model), ROWS)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_check_finite_must_be_a_bool(value):
  with pytest.raises(TypeError, match=f"check_finite={value!r}; expected True or False"):
    layer(check_finite=value)


def test_check_finite_is_refused_on_tpu_paths():
  config = config_lib.prepare(E.FeatureConfig(E.TableConfig(5, 2, name="t")), "sgd")
  with pytest.raises(
    ValueError, match="check_finite=True is an option of the CPU/GPU engine; on TPU_V1"
  ):
    backends.create(
      hardware.ExecutionPath.TPU_V1,
      config,
      pipelining=False,
      batch_size=None,
      sparse_core_embedding_config=None,
      table_updates="engine",
      check_finite=True,
    )


def test_fit_stops_at_the_first_non_finite_gradient():
  model_layer = layer(check_finite=True)
  inputs = tf_keras.Input(shape=(1,), dtype=tf.int64)
  outputs = tf_keras.layers.Dense(1)(model_layer({"watched": inputs})["watched"])
  model = tf_keras.Model(inputs, outputs)
  model.compile(tf_keras.optimizers.SGD(0.1), loss="mse")
  with pytest.raises(tf.errors.InvalidArgumentError, match="Feature 'watched'"):
    model.fit(np.array([[1], [3]]), np.array([[np.inf], [0.0]]), epochs=1, verbose=0)
  np.testing.assert_array_equal(table_of(model_layer), ROWS)


@pytest.mark.parametrize("size_threshold", [None, 0], ids=["replicated", "sharded"])
def test_partial_layer_checks_either_side(size_threshold):
  """The replicated side is built by the same backend factory as TPUEmbedding, so it takes
  check_finite too (it once bypassed the factory and had no such option)."""
  table = E.TableConfig(
    5, 2, name="videos", combiner="sum", initializer=tf.constant_initializer(ROWS)
  )
  model = tpu_embedding.PartialTPUEmbedding(
    {"watched": E.FeatureConfig(table)},
    E.SGD(learning_rate=0.5),
    size_threshold=size_threshold,
    check_finite=True,
  )
  with pytest.raises(
    tf.errors.InvalidArgumentError, match="Feature 'watched' \\(table 'videos'\\)"
  ):
    train(model, scale=float("inf"))
  np.testing.assert_array_equal(table_of(model), ROWS)
  train(model)
  expected = ROWS.copy()
  expected[[1, 3]] -= 0.5
  np.testing.assert_array_equal(table_of(model), expected)
