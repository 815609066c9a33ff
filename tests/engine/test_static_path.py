"""The static-shape engine path: chosen under XLA, compiled by it, and exact against the reference.

`tests/engine/test_engine.py` runs the property test on this path too; here: which path is chosen,
every
input kind and optimizer family in one `jit_compile` step, and both update formulations.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from tensorflow.python.tpu import tpu_replication  # the context TPUStrategy's replica steps run in

import tpu_embedding
from tpu_embedding.engine import static_path, updates

import reference

E = tf.tpu.experimental.embedding


def test_compiling_is_true_exactly_while_xla_compiles_the_graph():
  """The one TF internal this path reads: fails loudly if TF moves or changes it."""
  seen = {}

  def probe(name):
    seen[name] = static_path.compiling()
    return tf.constant(0)

  probe("eager")
  tf.function(lambda: probe("function"))()
  tf.function(lambda: probe("jit"), jit_compile=True)()
  model = tf_keras.Sequential(
    [tf_keras.layers.Lambda(lambda x: x + tf.cast(probe("keras_jit"), x.dtype))]
  )
  model.compile("sgd", "mse", jit_compile=True)
  model.train_on_batch(np.ones([2, 1]), np.ones([2, 1]))
  assert seen == {"eager": False, "function": False, "jit": True, "keras_jit": True}


def test_compiling_is_true_inside_tensorflows_tpu_replicate_context():
  """What `TPUStrategy.run` enters around each replica's step (TF's real class; no TPU needed)."""
  with tf.Graph().as_default():
    context = tpu_replication.TPUReplicateContext(b"replicate", num_replicas=2, pivot=tf.no_op())
    context.Enter()
    try:
      inside = static_path.compiling()
    finally:
      context.Exit()
    assert inside and not static_path.compiling()


OPTIMIZERS = {
  "sgd": lambda: E.SGD(0.5),
  "adagrad": lambda: E.Adagrad(0.5, initial_accumulator_value=0.2),
  "adagrad_momentum": lambda: E.AdagradMomentum(0.5, momentum=0.9, use_nesterov=True),
  "lazy_adam": lambda: E.Adam(0.5, lazy_adam=True),
  "adam": lambda: E.Adam(0.5, lazy_adam=False, clip_weight_min=-0.6, clip_weight_max=0.6),
  # Untouched rows take g = 0, not clip(0) = 0.05, and no decay (SPEC §2.2, §2.9).
  "adam_clipped_decayed": lambda: E.Adam(
    0.5, lazy_adam=False, clipvalue=(0.05, 0.3), weight_decay_factor=0.1
  ),
  "ftrl": lambda: E.FTRL(
    0.5, l1_regularization_strength=0.01, l2_regularization_strength=0.1, beta=0.5, clipvalue=0.3
  ),
}

# Three features on one table: dense [B, 1] ids, a ragged and a sparse bag per sample.
DENSE = [[1], [4], [1]]
RAGGED = [[0, 2, 2], [], [5]]
SPARSE = [[4, 1], [3], [1, 0]]  # ids of sample s at columns 0..; SparseTensor below
UPSTREAM = {
  k: np.arange(3 * 2, dtype=np.float32).reshape(3, 2) / 4 - s
  for s, k in enumerate(["dense", "ragged", "sparse"])
}


def _inputs():
  indices = [[s, c] for s, ids in enumerate(SPARSE) for c in range(len(ids))]
  sparse = tf.sparse.SparseTensor(
    indices, tf.constant([i for b in SPARSE for i in b], tf.int64), [3, 2]
  )
  return {
    "dense": tf.constant(DENSE, tf.int64),
    "ragged": tf.ragged.constant(RAGGED, tf.int64),
    "sparse": sparse,
  }


@pytest.mark.usefixtures("static_formulation")
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_jit_compiled_step_on_every_input_kind_matches_the_reference(name):
  rng = np.random.default_rng(0)
  values = rng.uniform(-0.5, 0.5, size=(7, 2)).astype(np.float32)  # row 6 is never looked up
  optimizer = OPTIMIZERS[name]()
  table = E.TableConfig(
    7, 2, combiner="mean", name="t", initializer=tf.constant_initializer(values)
  )
  layer = tpu_embedding.TPUEmbedding({k: E.FeatureConfig(table) for k in UPSTREAM}, optimizer)
  upstream = {k: tf.constant(v) for k, v in UPSTREAM.items()}

  @tf.function(jit_compile=True)
  def step(inputs):
    with tf.GradientTape() as tape:
      out = layer(inputs)
      loss = sum(tf.reduce_sum(out[k] * upstream[k]) for k in out)
    tape.gradient(loss, layer.trainable_variables)
    return out

  inputs = _inputs()
  params = reference.params_from_optimizer(optimizer)
  w = values.astype(np.float64)
  slots = reference.initial_slots(params, w.shape)
  bags = [(b, None) for b in [*[[i] for [i] in DENSE], *RAGGED, *SPARSE]]
  for _ in range(2):
    out = step(inputs)
    expected = [reference.combine_bag(w, ids, None, "mean") for ids, _ in bags]
    got = np.concatenate([out[k].numpy() for k in ("dense", "ragged", "sparse")])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    row_ids, grads = reference.assemble_gradients(
      bags, np.concatenate([UPSTREAM[k] for k in ("dense", "ragged", "sparse")]), "mean"
    )
    w, slots = reference.apply_step(w, slots, row_ids, grads, optimizer.learning_rate, params)
  variables = layer.variables_by_table["t"]
  np.testing.assert_allclose(variables["parameters"].numpy(), w, rtol=1e-5, atol=1e-6)
  for slot, value in slots.items():
    np.testing.assert_allclose(variables[slot].numpy(), value, rtol=1e-5, atol=1e-6)
  if params["kind"] != "adam" or params["lazy_adam"]:  # lazy rules leave row 6 bit-identical
    np.testing.assert_array_equal(variables["parameters"].numpy()[6], values[6])


@pytest.mark.usefixtures("static_formulation")
def test_under_xla_an_out_of_range_id_changes_no_row():
  """XLA cannot raise: the ids 7 and 9 of a 4-row table must drop their gradient, neither write
  a clamped row nor take the slot of the row they clamp to (7 comes before row 3's id)."""
  values = np.arange(8, dtype=np.float32).reshape(4, 2)
  table = E.TableConfig(4, 2, name="t", initializer=tf.constant_initializer(values))
  layer = tpu_embedding.TPUEmbedding(E.FeatureConfig(table), E.SGD(0.5))
  upstream = tf.constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0], [9.0, 10.0]])

  @tf.function(jit_compile=True)
  def step(ids):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(layer(ids) * upstream)
    tape.gradient(loss, layer.trainable_variables)

  step(tf.constant([[7], [3], [1], [9], [1]], tf.int64))
  expected = values.copy()
  expected[3] -= 0.5 * np.array([3.0, 4.0])
  expected[1] -= 0.5 * np.array([5.0 + 9.0, 6.0 + 10.0])
  np.testing.assert_array_equal(layer.variables_by_table["t"]["parameters"].numpy(), expected)


def test_pipelining_under_jit_compile_is_refused_with_the_reason():
  table = E.TableConfig(4, 2, name="t")
  layer = tpu_embedding.TPUEmbedding(
    E.FeatureConfig(table), E.SGD(0.1), pipeline_execution_with_tensor_core=True
  )

  @tf.function(jit_compile=True)
  def step(ids):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(layer(ids))
    return tape.gradient(loss, layer.trainable_variables)

  with pytest.raises(ValueError, match="pipeline_execution_with_tensor_core.*jit_compile"):
    step(tf.constant([1, 2]))


@pytest.mark.parametrize("training", [True, False])
def test_check_finite_under_jit_compile_is_refused_rather_than_skipped(training):
  """XLA has no run-time errors: compiled, the check would let a NaN into the table silently."""
  layer = tpu_embedding.TPUEmbedding(
    E.FeatureConfig(E.TableConfig(4, 2, name="t")), E.SGD(0.1), check_finite=True
  )

  @tf.function(jit_compile=True)
  def step(ids):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(layer(ids, training=training))
    return tape.gradient(loss, layer.trainable_variables)

  with pytest.raises(ValueError, match="check_finite=True.*without jit_compile"):
    step(tf.constant([1, 2]))


def test_update_for_takes_the_whole_table_while_it_is_small_next_to_the_steps_ids():
  """The size rule that `benchmarks/static_path_formulations.py` measures, at its boundary."""
  lazy = updates.rule_for(E.Adagrad(0.1))
  every_row = updates.rule_for(E.Adam(0.1, lazy_adam=False))
  whole, unique = updates.XlaForm.WHOLE_TABLE, updates.XlaForm.UNIQUE_ROWS
  limit = static_path.WHOLE_TABLE_ROWS_PER_ID * 100
  assert static_path.update_for(lazy, False, limit, 100) is whole
  assert static_path.update_for(lazy, False, limit + 1, 100) is unique
  assert static_path.update_for(lazy, False, 10, None) is unique  # capacity unknown at trace
  assert static_path.update_for(lazy, True, 10**6, 100) is whole  # replicas sum whole tables
  assert static_path.update_for(every_row, False, 10**6, None) is whole
