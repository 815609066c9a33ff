"""Tests of `tpu_embedding.engine.checks`: hostile or ill-formed input refused by feature name.

Inputs that once aborted the process are tried in a child process, so that an abort fails the
test instead of killing pytest. Expected activations come from NumPy on a table whose rows are
their own ids.
"""

import json
import os
import re

import numpy as np
import pytest
import tensorflow as tf

import child_process
from input_layers import DIM, VALUES, E, layer, train_step, weights_cases
from unchanged import assert_unchanged, snapshot

# ---------------------------------------------------------------------------------------------
# SparseTensors that describe no valid input are refused before any op sees them

HOSTILE_SPARSE = {  # name: (indices, values, dense_shape, what the refusal says)
  "huge_dense_shape": ([[0, 0]], [1], [2**61, 3], "at most 2147483647 samples"),
  "negative_dense_shape": ([[0, 0]], [1], [-1, 3], "must be non-negative"),
  "index_outside": ([[0, 0], [5, 1]], [1, 2], [2, 3], "must lie inside dense_shape"),
  "negative_index": ([[0, -1]], [1], [2, 3], "must lie inside dense_shape"),
  "indices_without_values": ([[0, 0], [1, 0]], [1], [2, 3], "one row per value"),
}

HERE = os.path.dirname(os.path.abspath(__file__))
_CHILD = """
import json, os, sys
import tensorflow as tf
sys.path[:0] = {folders!r}
from test_checks import HOSTILE_SPARSE
from input_layers import layer
from tpu_embedding.engine import native

def run(mode, indices, values, shape):
  model = layer()
  as_sparse = lambda i, v, s: tf.SparseTensor(i, v, s)
  def call(i, v, s):
    if mode.endswith("tape"):
      with tf.GradientTape():
        return model({{"f": as_sparse(i, v, s)}})
    return model({{"f": as_sparse(i, v, s)}})
  tensors = (tf.constant(indices, tf.int64, [len(indices), len(shape)]),
             tf.constant(values, tf.int64), tf.constant(shape, tf.int64))
  if mode.startswith("signature"):  # what an exported serving signature traces
    spec = [tf.TensorSpec([None, None], tf.int64), tf.TensorSpec([None], tf.int64),
            tf.TensorSpec([None], tf.int64)]
    return tf.function(call, input_signature=spec)(*tensors)
  if mode.startswith("traced"):  # a tf.function traced for this SparseTensor's static shape
    return tf.function(lambda sp: call(sp.indices, sp.values, sp.dense_shape))(
        as_sparse(*tensors))
  return call(*tensors)

for path, switch in (("native", "1"), ("tf_ops", "0")):  # the engine's two paths
  os.environ[native.ENV_SWITCH] = switch
  for name, (indices, values, shape, _) in HOSTILE_SPARSE.items():
    for mode in ("eager", "eager_tape", "traced_tape", "signature", "signature_tape"):
      if name == "indices_without_values" and not mode.startswith("signature"):
        continue  # the SparseTensor constructor itself refuses it
      # the last line shows where an abort happened
      print(json.dumps([path, name, mode]), flush=True)
      try:
        run(mode, indices, values, shape)
        print(json.dumps("accepted"), flush=True)
      except (ValueError, tf.errors.InvalidArgumentError) as e:
        print(json.dumps(str(e)), flush=True)
"""


@pytest.mark.integration  # starts a process
def test_hostile_sparse_inputs_are_refused_naming_the_feature_without_aborting():
  """On both engine paths, in one child (each path as the `engine_path` fixture sets it)."""
  stdout = child_process.run_python(
    _CHILD.format(folders=[HERE, os.path.join(child_process.ROOT, "tests", "support")]), 300
  )
  lines = [json.loads(line) for line in stdout.splitlines()]
  results = dict(zip(map(tuple, lines[::2]), lines[1::2]))
  assert len(results) == 2 * (4 * 5 + 2)
  assert {path for path, _, _ in results} == {"native", "tf_ops"}
  for (path, name, mode), message in results.items():
    assert re.search(r"Feature \\*'f\\*'", message), (path, name, mode, message)
    assert HOSTILE_SPARSE[name][3] in message, (path, name, mode, message)


def test_a_refused_sparse_input_changes_no_table(engine_path):
  model = layer()
  model({"f": tf.constant([0])})
  before = model.embedding_tables
  before = {t: v.numpy() for t, v in before.items()}
  with pytest.raises(ValueError, match="must lie inside dense_shape"):
    with tf.GradientTape() as tape:
      out = model({"f": tf.SparseTensor([[0, 0], [0, 7]], tf.constant([1, 2], tf.int64), [1, 3])})
      tape.gradient(tf.reduce_sum(out["f"]), model.trainable_variables)
  for t, v in model.embedding_tables.items():
    np.testing.assert_array_equal(v.numpy(), before[t])


# ---------------------------------------------------------------------------------------------
# Weights pair with their ids, or are refused


@pytest.mark.parametrize("kind", ["sparse", "ragged"])
@pytest.mark.parametrize("traced", [False, True])
def test_weights_laid_out_differently_from_the_ids_are_refused(kind, traced):
  ids, weights = weights_cases()[kind]
  model = layer()
  call = lambda i, w: model({"f": i}, weights={"f": w})
  if traced:
    call = tf.function(call)
  error = tf.errors.InvalidArgumentError if traced else ValueError
  what = "indices and dense_shape" if kind == "sparse" else "row lengths"
  with pytest.raises(error, match=f"Feature \\\\*'f\\\\*': its weights must have the same {what}"):
    call(ids, weights)


@pytest.mark.parametrize("kind", ["sparse", "ragged"])
def test_unvalidated_weights_pair_by_value_order(kind):
  ids, weights = weights_cases()[kind]
  out = layer(validate_weights_and_indices=False)({"f": ids}, weights={"f": weights})["f"]
  expected = np.stack([2.0 * VALUES[1] + 3.0 * VALUES[3], 5.0 * VALUES[4]])
  np.testing.assert_array_equal(out.numpy(), expected)


@pytest.mark.parametrize("kind", ["sparse", "ragged"])
@pytest.mark.parametrize("validate", [True, False])
def test_a_weight_count_other_than_the_ids_is_refused(kind, validate):
  ids, _ = weights_cases()[kind]
  if kind == "sparse":
    weights = tf.SparseTensor([[0, 0], [0, 1]], [2.0, 3.0], [2, 2])
  else:
    weights = tf.ragged.constant([[2.0, 3.0], []])
  with pytest.raises(
    ValueError,
    match=r"Feature 'f': its weights must hold one value per id.*"
    r"Got: 2, 3",
  ):
    layer(validate_weights_and_indices=validate)({"f": ids}, weights={"f": weights})


def test_an_output_shape_other_than_the_batch_is_refused_naming_the_feature():
  model = layer(output_shape=[4])
  with pytest.raises(
    ValueError,
    match=r"Feature 'f': FeatureConfig.output_shape \[4\] holds 4 "
    r"samples.*Got: 3",
  ):
    model({"f": tf.constant([1, 2, 3])})


# ---------------------------------------------------------------------------------------------
# Inputs that were once dropped or misread without a word


@pytest.mark.parametrize("kind", ["dense", "sparse", "ragged"])
@pytest.mark.parametrize("traced", [False, True])
def test_an_out_of_range_id_past_max_sequence_length_is_refused_not_truncated_away(kind, traced):
  rows = [[1, 2, 3, 4, 99], [5]]  # 99 at position 4: past the 3 positions looked up
  ids = {
    "dense": tf.constant([[1, 2, 3, 4, 99], [5, 0, 0, 0, 0]], tf.int64),
    "sparse": tf.ragged.constant(rows, tf.int64).to_sparse(),
    "ragged": tf.ragged.constant(rows, tf.int64),
  }[kind]
  assert_refused_by_the_range_check(layer(max_sequence_length=3), ids, traced, r"\[99\]")


def assert_refused_by_the_range_check(model, ids, traced, offending):
  """A training step on `ids` (feature 'f') is refused by the id-range check, which lists the
  `offending` ids (a regex), eagerly or traced (Assert's message escapes quotes and brackets
  each item), and changes no variable."""
  model.build(None)
  before = snapshot(model)
  signature = {"f": tf.type_spec_from_value(ids)} if traced else None
  with pytest.raises(
    tf.errors.InvalidArgumentError if traced else ValueError,
    match=r"(?s)Feature \\?'f\\?' \(table \\?'t\\?', vocabulary_size=10\): every id must be "
    r"in \[0, 10\)\.\]? \[?Offending ids:\]? " + offending,
  ):
    train_step(model, {"f": ids}, signature)
  assert_unchanged(before, model)


@pytest.mark.parametrize("outside", [[2, 0], [0, 5], [-1, 2], [1, -4]])
def test_under_xla_a_sparse_entry_outside_dense_shape_is_dropped_as_if_absent(outside):
  indices, ids, shape = [[0, 0], [1, 1], [0, 2]], [1, 2, 3], [2, 3]

  def jit_step(model, sparse):
    @tf.function(jit_compile=True)
    def step(indices, values):
      with tf.GradientTape() as tape:
        out = model({"f": tf.SparseTensor(indices, values, shape)})["f"]
        loss = tf.reduce_sum(out * tf.constant([[1.0, 2.0], [3.0, 4.0]]))
      tape.gradient(loss, model.trainable_variables)
      return out

    return step(sparse.indices, sparse.values).numpy()

  valid = tf.SparseTensor(tf.constant(indices, tf.int64), tf.constant(ids, tf.int64), shape)
  hostile = tf.SparseTensor(
    tf.constant(indices + [outside], tf.int64), tf.constant(ids + [9], tf.int64), shape
  )
  expected_model, model = layer("mean"), layer("mean")
  expected = jit_step(expected_model, valid)
  np.testing.assert_array_equal(expected, [VALUES[[1, 3]].mean(0), VALUES[2]])  # the valid input
  np.testing.assert_array_equal(jit_step(model, hostile), expected)
  np.testing.assert_array_equal(
    model.variables_by_table["t"]["parameters"].numpy(),
    expected_model.variables_by_table["t"]["parameters"].numpy(),
  )
  with pytest.raises(ValueError, match="Feature 'f': every index of its SparseTensor must lie"):
    layer("mean")({"f": hostile})  # the other paths refuse it


# ---------------------------------------------------------------------------------------------
# Ids of every integer dtype: looked up by their value; uint64 ids past int64 named as given

INTEGER_DTYPES = [tf.int8, tf.uint8, tf.int16, tf.uint16, tf.int32, tf.uint32, tf.int64, tf.uint64]


@pytest.mark.parametrize("dtype", INTEGER_DTYPES, ids=lambda d: d.name)
def test_ids_of_every_integer_dtype_read_the_rows_of_their_values(dtype):
  out = train_step(layer(), {"f": tf.constant([1, 9], dtype)})
  np.testing.assert_array_equal(out["f"], [[2, 3], [18, 19]])


def uint64_ids(kind):
  """Ids 1, 2**63 + 5 and 2**64 - 1 as uint64: the last two past int64's range."""
  values = tf.constant([1, 2**63 + 5, 2**64 - 1], tf.uint64)
  rows = tf.RaggedTensor.from_row_lengths(values, [2, 1])
  return {"dense": values, "ragged": rows, "sparse": rows.to_sparse()}[kind]


@pytest.mark.parametrize("kind", ["dense", "sparse", "ragged"])
@pytest.mark.parametrize("traced", [False, True])
def test_uint64_ids_past_int64_are_refused_with_their_true_values(kind, traced):
  offending = r"\[9223372036854775813,? 18446744073709551615\]"
  assert_refused_by_the_range_check(layer(), uint64_ids(kind), traced, offending)


def test_under_xla_uint64_ids_past_int64_are_clamped_to_the_last_row_like_any_too_large_id():
  model = layer()
  lookup = tf.function(lambda ids: model({"f": ids})["f"], jit_compile=True)
  out = lookup(tf.constant([2**63 + 5, 2**64 - 1, 11, 3], tf.uint64))
  np.testing.assert_array_equal(out, [[18, 19], [18, 19], [18, 19], [6, 7]])


@pytest.mark.parametrize("kind", ["partial", "keras3"])
def test_partial_and_keras3_layers_name_uint64_ids_past_int64_by_their_true_values(kind):
  from tpu_embedding.keras import TPUEmbedding as Keras3TPUEmbedding
  from tpu_embedding.partial import PartialTPUEmbedding

  small = E.TableConfig(10, DIM, name="t")  # replicated by Partial, looked up by the engine
  large = E.TableConfig(40, DIM, name="u")  # sharded by Partial
  config = {"f": E.FeatureConfig(small), "g": E.FeatureConfig(large)}
  if kind == "partial":
    model = PartialTPUEmbedding(config, "sgd", size_threshold=20)
  else:
    model = Keras3TPUEmbedding(config, "sgd")
  for name, size in [("f", 10), ("g", 40)]:
    features = {"f": tf.constant([1], tf.uint64), "g": tf.constant([1], tf.uint64)}
    features[name] = tf.constant([2, 2**63 + 5], tf.uint64)
    with pytest.raises(
      ValueError,
      match=rf"Feature '{name}' .*\[0, {size}\)\. Offending ids: \[9223372036854775813\]",
    ):
      model(features)
