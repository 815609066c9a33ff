"""Tests of `tpu_embedding.keras.config_conversion`: keras-rs configs -> mid-level configs."""

import keras
import keras_rs
import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding.keras import config_conversion

E = tf.tpu.experimental.embedding


def rs_table(name="movies", **kwargs):
  args = dict(name=name, vocabulary_size=10, embedding_dim=4, optimizer="adam")
  args.update(kwargs)
  return keras_rs.layers.TableConfig(**args)


def rs_feature(table, name="movie", batch=8, output_shape=None):
  return keras_rs.layers.FeatureConfig(
    name=name,
    table=table,
    input_shape=(batch,),
    output_shape=output_shape or (batch, table.embedding_dim),
  )


def test_table_fields_and_string_optimizer_follow_keras():
  table = config_conversion.to_mid_level_table(rs_table(combiner="sqrtn"))
  assert (table.name, table.vocabulary_size, table.dim, table.combiner) == (
    "movies",
    10,
    4,
    "sqrtn",
  )
  # "adam" is Keras' Adam with its defaults, translated as any Keras Adam is.
  assert isinstance(table.optimizer, E.Adam)
  assert (table.optimizer.beta_1, table.optimizer.beta_2) == (0.9, 0.999)
  np.testing.assert_allclose(float(table.optimizer.learning_rate()), 0.001)
  # keras-rs's default initializer (a Keras VarianceScaling) is kept and gives Keras' values.
  values = table.initializer(shape=(10, 4), dtype=tf.float32)
  assert values.shape == (10, 4) and float(tf.math.reduce_std(values)) > 0


def test_keras_optimizer_object_and_initializer_string():
  table = config_conversion.to_mid_level_table(
    rs_table(
      optimizer=keras.optimizers.Adagrad(0.3, initial_accumulator_value=0.5), initializer="zeros"
    )
  )
  assert isinstance(table.optimizer, E.Adagrad)
  assert table.optimizer.initial_accumulator_value == 0.5
  np.testing.assert_allclose(float(table.optimizer.learning_rate()), 0.3)
  np.testing.assert_array_equal(table.initializer(shape=(2, 2), dtype=tf.float32), np.zeros((2, 2)))


def test_untranslatable_optimizer_names_the_table():
  with pytest.raises(ValueError, match="keras-rs TableConfig 'movies'.optimizer.*RMSprop"):
    config_conversion.to_mid_level_table(rs_table(optimizer=keras.optimizers.RMSprop()))


@pytest.mark.parametrize("field", ["optimizer", "initializer"])
def test_an_unknown_optimizer_or_initializer_name_names_the_table(field):
  with pytest.raises(
    ValueError,
    match=rf"keras-rs TableConfig 'movies'.{field}='no_such_{field}': Keras has no {field} of "
    "that name",
  ):
    config_conversion.to_mid_level_table(rs_table(**{field: f"no_such_{field}"}))


def test_default_device_placement_is_refused_with_the_remedy():
  with pytest.raises(
    ValueError, match="'movies' has placement='default_device'.*DistributedEmbedding"
  ):
    config_conversion.to_mid_level_table(rs_table(placement="default_device"))


def test_nest_shares_tables_and_keeps_mid_level_leaves():
  movies, users = rs_table(), rs_table("users")
  mid_level = E.FeatureConfig(E.TableConfig(5, 2, name="age"))
  nest = {
    "movie": rs_feature(movies),
    "watched": rs_feature(movies, "watched"),
    "user": [rs_feature(users, "user")],
    "age": mid_level,
  }
  converted = config_conversion.to_mid_level(nest)
  assert converted["age"] is mid_level
  assert converted["movie"].table is converted["watched"].table
  assert converted["movie"].table is not converted["user"][0].table
  assert converted["user"][0].name == "user" and converted["user"][0].table.name == "users"


def test_global_output_shape_becomes_per_replica_without_the_dimension():
  feature = rs_feature(rs_table(), batch=8, output_shape=(8, 3, 4))
  table = config_conversion.to_mid_level_table(feature.table)
  assert config_conversion.to_mid_level_feature(feature, table, 2).output_shape == [4, 3]
  # (batch, dim) is the input's own shape: not fixed, so any batch size is served.
  for shape in [(8, 4), (None, 4), (None, 3, 4)]:
    unfixed = rs_feature(rs_table(), output_shape=shape)
    assert config_conversion.to_mid_level_feature(unfixed, table, 2).output_shape.rank is None


@pytest.mark.parametrize(
  "output_shape,match",
  [
    ((8, 5), r"output_shape=\(8, 5\); expected \(batch, \.\.\., 4\)"),
    ((4,), r"output_shape=\(4,\)"),
    ((9, 4), "batch size 9 of output_shape is not a multiple of the 2 replicas"),
  ],
)
def test_bad_output_shapes_name_the_feature(output_shape, match):
  feature = rs_feature(rs_table(), output_shape=output_shape)
  table = config_conversion.to_mid_level_table(feature.table)
  with pytest.raises(ValueError, match="keras-rs FeatureConfig 'movie'.*" + match):
    config_conversion.to_mid_level_feature(feature, table, 2)
