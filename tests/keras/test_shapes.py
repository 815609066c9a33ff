"""Symbolic outputs of the Keras 3 layers (`tpu_embedding.keras.shapes`): functional models
build with the activations' real shapes, for every input kind, with and without weights."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding.keras import DistributedEmbedding, PartialTPUEmbedding, TPUEmbedding

E = tf.tpu.experimental.embedding
DIM = 7


def config(max_sequence_length=0):
  table = E.TableConfig(23, DIM, combiner="sum", name="t", optimizer=E.SGD(0.1))
  return {"f": E.FeatureConfig(table, max_sequence_length=max_sequence_length, name="f")}


def symbolic(kind, shape=(13,), dtype="int32"):
  """A named Keras input (a dict of inputs warns unless each is named)."""
  ragged, sparse = kind == "ragged", kind == "sparse"
  return keras.Input(
    shape, dtype=dtype, ragged=ragged, sparse=sparse, name="f" if dtype == "int32" else "f_weights"
  )


def functional_output(layer, kind, shape=(13,), weighted=False):
  ids = {"f": symbolic(kind, shape)}
  weights = {"f": symbolic(kind, shape, "float32")} if weighted else None
  output = layer(ids, weights)["f"]
  keras.Model([ids, weights] if weighted else ids, output)  # the model builds
  return tuple(output.shape)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("kind", ["ragged", "sparse"])
@pytest.mark.parametrize("layer_class", [TPUEmbedding, PartialTPUEmbedding])
def test_bags_give_one_activation_per_row(layer_class, kind, weighted):
  assert functional_output(layer_class(config()), kind, weighted=weighted) == (None, DIM)


@pytest.mark.parametrize(
  "kind,shape,expected",
  [
    ("dense", (1,), (None, DIM)),  # [B, 1] gives [B, D], as on TPU
    ("dense", (), (None, DIM)),
    ("dense", (3,), (None, 3, DIM)),  # each dense id is its own sample
    ("ragged", (13,), (None, 5, DIM)),  # a sequence feature: max_sequence_length positions
  ],
)
def test_mid_level_shapes_follow_the_input_and_the_feature(kind, shape, expected):
  sequence = 5 if kind == "ragged" else 0
  assert functional_output(TPUEmbedding(config(sequence)), kind, shape) == expected


def test_a_configured_output_shape_keeps_the_inputs_batch():
  table = E.TableConfig(23, DIM, name="t", optimizer=E.SGD(0.1))
  layer = TPUEmbedding({"f": E.FeatureConfig(table, output_shape=[8, 2], name="f")})
  assert functional_output(layer, "dense", (2,)) == (None, 2, DIM)


@pytest.mark.parametrize("kind,shape", [("dense", (4,)), ("dense", ()), ("ragged", (4,))])
def test_distributed_embedding_reduces_every_bag(kind, shape):
  layer = DistributedEmbedding(config())
  assert functional_output(layer, kind, shape, weighted=True) == (None, DIM)


def test_compute_output_shape_reads_shapes_as_dense():
  assert TPUEmbedding(config()).compute_output_shape({"f": (8, 1)}) == {"f": (8, DIM)}
  assert TPUEmbedding(config(5)).compute_output_shape({"f": (8, 3)}) == {"f": (8, 5, DIM)}
  assert DistributedEmbedding(config()).compute_output_shape({"f": (8, 3)}) == {"f": (8, DIM)}


def test_the_functional_model_computes_what_its_symbolic_shape_says():
  layer = TPUEmbedding(config())
  ids = keras.Input((None,), dtype="int32", ragged=True)
  model = keras.Model(ids, layer({"f": ids})["f"])
  out = model(tf.ragged.constant([[1, 2], [3]]))
  table = layer.embedding_tables[
    layer.embedding_config.user_tables[layer.embedding_config.tables[0]]
  ]
  np.testing.assert_allclose(out, [table[1] + table[2], table[3]], rtol=1e-6)
