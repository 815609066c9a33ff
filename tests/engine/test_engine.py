"""The CPU engine through the layer: TPU semantics over several steps, pipelining, table modes.

The property test compares the engine with `tests/support/reference.py`, a float64 NumPy
transcription of
the semantics spec written independently of the engine.
"""

import warnings

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tpu_embedding

import reference

E = tf.tpu.experimental.embedding


def _table(values, combiner="sum", name="t", optimizer=None):
  return E.TableConfig(
    vocabulary_size=values.shape[0],
    dim=values.shape[1],
    combiner=combiner,
    name=name,
    optimizer=optimizer,
    initializer=tf.constant_initializer(values),
  )


class Probe(tf_keras.Model):
  """loss = sum_f <activation_f, upstream_f>, so activation gradients are exactly `upstream`."""

  def __init__(self, layer):
    super().__init__()
    self.embedding = layer

  def call(self, inputs):
    ids, weights, upstream = inputs
    out = self.embedding(ids, weights)
    pairs = zip(tf.nest.flatten(out), tf.nest.flatten(upstream))
    return out, sum(tf.reduce_sum(a * tf.cast(g, tf.float32)) for a, g in pairs)


def _step(model, dense_optimizer, ids, weights, upstream):
  with tf.GradientTape() as tape:
    out, loss = model((ids, weights, upstream))
  variables = model.trainable_variables
  dense_optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
  return out


# ---------------------------------------------------------------------------------------------
# Property test against the reference


@st.composite
def optimizers(draw):
  kind = draw(st.sampled_from(["sgd", "adagrad", "adagrad_momentum", "adam", "adam_dense", "ftrl"]))
  lr = draw(st.sampled_from([0.05, 0.3]))
  common = {}
  if draw(st.booleans()):
    common["clipvalue"] = draw(st.sampled_from([0.2, (-0.1, 0.3)]))
  if draw(st.booleans()):
    common["clip_weight_min"], common["clip_weight_max"] = -1.5, 1.0
  if draw(st.booleans()) and kind != "ftrl":
    common["weight_decay_factor"] = 0.05
    common["multiply_weight_decay_factor_by_learning_rate"] = draw(st.booleans())
  if kind == "sgd":
    return E.SGD(lr, **common)
  if kind == "adagrad":
    return E.Adagrad(lr, initial_accumulator_value=draw(st.sampled_from([0.1, 1.0])), **common)
  if kind == "adagrad_momentum":
    return E.AdagradMomentum(
      lr,
      momentum=0.9,
      use_nesterov=draw(st.booleans()),
      beta2=draw(st.sampled_from([1.0, 0.9])),
      **common,
    )
  if kind in ("adam", "adam_dense"):
    return E.Adam(lr, lazy_adam=kind == "adam", sum_inside_sqrt=draw(st.booleans()), **common)
  return E.FTRL(
    lr,
    l1_regularization_strength=draw(st.sampled_from([0.0, 0.01])),
    l2_regularization_strength=0.1,
    beta=draw(st.sampled_from([0.0, 0.5])),
    multiply_linear_by_learning_rate=draw(st.booleans()),
    **common,
  )


bags_strategy = st.lists(st.lists(st.integers(0, 5), max_size=4), min_size=1, max_size=4)


def _reference_examples(max_examples: int, max_steps: int, **more):
  """The property tests' settings and examples: a table, its optimizer, steps of two features."""
  settings = hypothesis.settings(
    max_examples=max_examples,
    deadline=None,
    suppress_health_check=[
      hypothesis.HealthCheck.too_slow,
      hypothesis.HealthCheck.function_scoped_fixture,
    ],
  )
  given = hypothesis.given(
    dim=st.integers(1, 3),
    combiner=st.sampled_from(["sum", "mean", "sqrtn"]),
    optimizer=optimizers(),
    steps=st.lists(st.tuples(bags_strategy, bags_strategy), min_size=1, max_size=max_steps),
    weighted=st.booleans(),
    seed=st.integers(0, 2**16),
    **more,
  )
  return lambda test: settings(given(test))


@pytest.mark.usefixtures("engine_path")  # the same for every example: only sets the path
@_reference_examples(30, 3, compiled=st.booleans())
def test_engine_matches_reference(dim, combiner, optimizer, steps, weighted, compiled, seed):
  """Two features sharing one table, duplicate-heavy bags, several steps: tables and slots.

  Compiled steps take the graph-only paths (one id check per step, the update reusing the rows
  the lookup read); eager steps the others.
  """
  run_step = tf.function(_step, reduce_retracing=True) if compiled else _step
  _check_against_reference(run_step, dim, combiner, optimizer, steps, weighted, seed)


@pytest.mark.usefixtures("static_formulation")
@_reference_examples(8, 2)
def test_jit_compiled_steps_match_reference(dim, combiner, optimizer, steps, weighted, seed):
  """The same under `jit_compile=True` (the static-shape path), with each of its two update
  formulations whatever the table's size; fewer examples, as each one compiles with XLA."""
  run_step = tf.function(_step, reduce_retracing=True, jit_compile=True)
  _check_against_reference(run_step, dim, combiner, optimizer, steps, weighted, seed)


def _check_against_reference(run_step, dim, combiner, optimizer, steps, weighted, seed):
  rng = np.random.default_rng(seed)
  rows = 6
  values = rng.uniform(-1, 1, size=(rows, dim)).astype(np.float32)
  table = _table(values, combiner)
  layer = tpu_embedding.TPUEmbedding(
    {"a": E.FeatureConfig(table=table), "b": E.FeatureConfig(table=table)}, optimizer
  )
  model = Probe(layer)
  dense = tf_keras.optimizers.SGD(0.0)
  params = reference.params_from_optimizer(optimizer)
  w = values.astype(np.float64)
  slots = reference.initial_slots(params, w.shape)
  for bags_a, bags_b in steps:
    weights = {
      k: [list(rng.uniform(-0.5, 2.0, len(b))) for b in bags] if weighted else None
      for k, bags in (("a", bags_a), ("b", bags_b))
    }
    upstream = {
      k: rng.normal(size=(len(bags), dim)).astype(np.float32)
      for k, bags in (("a", bags_a), ("b", bags_b))
    }
    ids = {
      "a": tf.ragged.constant(bags_a, tf.int64, ragged_rank=1),
      "b": tf.ragged.constant(bags_b, tf.int64, ragged_rank=1),
    }
    tf_weights = (
      None
      if not weighted
      else {k: tf.ragged.constant(weights[k], tf.float32, ragged_rank=1) for k in weights}
    )
    out = run_step(model, dense, ids, tf_weights, upstream)
    for k, bags in (("a", bags_a), ("b", bags_b)):
      expected = [
        reference.combine_bag(w, b, None if not weighted else weights[k][i], combiner)
        for i, b in enumerate(bags)
      ]
      np.testing.assert_allclose(
        out[k].numpy(), np.reshape(expected, (-1, dim)), rtol=1e-4, atol=1e-5
      )
    samples = [
      (b, None if not weighted else weights[k][i])
      for k, bags in (("a", bags_a), ("b", bags_b))
      for i, b in enumerate(bags)
    ]
    row_ids, grads = reference.assemble_gradients(
      samples, np.concatenate([upstream["a"], upstream["b"]]), combiner, dim
    )
    if len(row_ids) or (params["kind"] == "adam" and not params["lazy_adam"]):
      w, slots = reference.apply_step(w, slots, row_ids, grads, optimizer.learning_rate, params)
  variables = layer.variables_by_table["t"]
  np.testing.assert_allclose(variables["parameters"].numpy(), w, rtol=2e-4, atol=2e-5)
  for name, value in slots.items():
    np.testing.assert_allclose(variables[name].numpy(), value, rtol=2e-4, atol=2e-5)


# ---------------------------------------------------------------------------------------------
# The update writes back rows computed from the rows the lookup read: never stale ones


def _sgd_layer(values):
  return tpu_embedding.TPUEmbedding(E.FeatureConfig(table=_table(values)), E.SGD(1.0))


def test_two_lookups_of_one_table_in_one_step_both_reach_the_table():
  values = np.arange(8, dtype=np.float32).reshape(4, 2)
  layer = _sgd_layer(values)

  @tf.function
  def step():
    with tf.GradientTape() as tape:
      first = layer(tf.constant([1, 2]))
      second = layer(tf.constant([2, 3]))
      loss = tf.reduce_sum(first) + 2.0 * tf.reduce_sum(second)
    tape.gradient(loss, layer.trainable_variables)

  step()
  expected = values - np.array([[0], [1], [1 + 2], [2]], np.float32)  # row 2 gets both
  np.testing.assert_array_equal(list(layer.embedding_tables.values())[0].numpy(), expected)


def test_each_gradient_of_a_persistent_tape_updates_the_current_rows():
  values = np.zeros((3, 1), np.float32)
  layer = _sgd_layer(values)

  @tf.function
  def step():
    with tf.GradientTape(persistent=True) as tape:
      loss = tf.reduce_sum(layer(tf.constant([1, 1, 2])))
    tape.gradient(loss, layer.trainable_variables)
    tape.gradient(loss, layer.trainable_variables)

  with pytest.warns(UserWarning, match="received a second gradient.*updated them again"):
    step()
  np.testing.assert_array_equal(
    list(layer.embedding_tables.values())[0].numpy(), [[0.0], [-4.0], [-2.0]]
  )  # two steps of -(1 + 1) and -1


@pytest.mark.parametrize("run", [lambda f: f(), lambda f: tf.function(f)()], ids=["eager", "graph"])
def test_a_gradient_asked_only_for_other_variables_still_updates_the_rows(run):
  """TF's tape runs the gradient of every op between the loss and the activations, whatever the
  sources asked for (as tfrs's trap on TPU): the update is not keyed to the trap variable."""
  layer = _sgd_layer(np.zeros((3, 1), np.float32))
  unrelated = tf.Variable(1.0)

  def step():
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(layer(tf.constant([1, 1, 2])))
    tape.gradient(loss, [unrelated])

  run(step)
  np.testing.assert_array_equal(
    list(layer.embedding_tables.values())[0].numpy(), [[0.0], [-2.0], [-1.0]]
  )


def test_one_gradient_per_step_gives_no_warning():
  layer = _sgd_layer(np.zeros((3, 1), np.float32))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for _ in range(2):  # eager: one lookup and one gradient per step
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(tf.constant([1])))
      tape.gradient(loss, layer.trainable_variables)
  np.testing.assert_array_equal(
    list(layer.embedding_tables.values())[0].numpy(), [[0.0], [-2.0], [0.0]]
  )


def test_a_compiled_training_step_reads_each_touched_table_row_once(engine_path):
  layer = tpu_embedding.TPUEmbedding(
    E.FeatureConfig(table=_table(np.zeros((5, 2), np.float32))), E.Adagrad(0.1)
  )

  @tf.function
  def step(ids):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(layer(ids))
    tape.gradient(loss, layer.trainable_variables)

  graph = step.get_concrete_function(tf.TensorSpec([None], tf.int64)).graph
  types = [op.type for op in graph.get_operations()]
  counted = (
    "Unique",
    "ResourceGather",
    "TpuEmbeddingDedupLookup",
    "TpuEmbeddingRowGradients",
    "TpuEmbeddingApplyRows",
  )
  if engine_path == "native":  # one kernel looks up, one sums the gradients, one updates
    assert [types.count(t) for t in counted] == [0, 0, 1, 1, 1]
  else:  # the table's rows (looked up, then updated) and the accumulator's
    assert [types.count(t) for t in counted] == [1, 2, 0, 0, 0]


# ---------------------------------------------------------------------------------------------
# Pipelining emulation


def _constant_gradient_lookups(pipelining: bool, steps: int = 4):
  """SPEC §6's example: one row, SGD lr 1, gradient 1 each step, starting at 0."""
  table = _table(np.zeros((2, 1), np.float32))
  layer = tpu_embedding.TPUEmbedding(
    E.FeatureConfig(table=table), E.SGD(1.0), pipeline_execution_with_tensor_core=pipelining
  )
  seen = []

  @tf.function
  def step():
    with tf.GradientTape() as tape:
      activation = layer(tf.constant([1]))
      loss = tf.reduce_sum(activation)
    tape.gradient(loss, layer.trainable_variables)
    return activation

  for _ in range(steps):
    seen.append(float(step().numpy()[0, 0]))
  return layer, seen


def test_without_pipelining_each_lookup_sees_the_previous_update():
  _, seen = _constant_gradient_lookups(False)
  assert seen == [0.0, -1.0, -2.0, -3.0]


def test_pipelining_lookups_see_step_n_minus_2_and_flush_applies_the_rest():
  layer, seen = _constant_gradient_lookups(True)
  assert seen == [0.0, 0.0, -1.0, -2.0]
  table = layer.variables_by_table["t"]["parameters"]
  assert table.numpy()[1, 0] == -3.0  # step 4's update is still pending
  layer.flush()
  assert table.numpy()[1, 0] == -4.0
  layer.flush()  # nothing left: idempotent
  assert table.numpy()[1, 0] == -4.0


def test_pipelined_update_is_flushed_before_a_checkpoint_is_written(tmp_path):
  layer, _ = _constant_gradient_lookups(True, steps=2)
  path = tf.train.Checkpoint(layer=layer).write(str(tmp_path / "ckpt"))
  saved = tf.train.load_checkpoint(path).get_tensor(
    "layer/_tpu_embedding/t/.ATTRIBUTES/VARIABLE_VALUE"
  )
  assert saved[1, 0] == -2.0


# ---------------------------------------------------------------------------------------------
# Learning rates, Keras-managed tables, slots in checkpoints


def test_keras_schedule_drives_table_learning_rate_step_by_step():
  schedule = tf_keras.optimizers.schedules.PiecewiseConstantDecay([0], [1.0, 0.25])
  keras_sgd = tf_keras.optimizers.SGD(schedule)
  table = _table(np.zeros((3, 2), np.float32))
  layer = tpu_embedding.TPUEmbedding(E.FeatureConfig(table=table), keras_sgd)
  dense = tf_keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")

  @tf.function
  def step(ids):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(dense(layer(ids)))
    variables = layer.trainable_variables + dense.trainable_variables
    keras_sgd.apply_gradients(zip(tape.gradient(loss, variables), variables))

  step(tf.constant([1]))  # iterations 0 -> lr 1.0, gradient 1 (dense kernel is ones)
  row_after_one = layer.embedding_tables[table].numpy()[1].copy()
  # iterations 1 -> lr 0.25, gradient 1: the kernel as step 1 left it (moved by -1.0 * activation
  # = 0), not as this step's own update leaves it (tests/engine/test_trap.py)
  step(tf.constant([1]))
  np.testing.assert_allclose(row_after_one, [-1.0, -1.0])
  np.testing.assert_allclose(layer.embedding_tables[table].numpy()[1], [-1.25, -1.25])


def test_callable_learning_rate_of_a_mid_level_optimizer_is_read_every_step():
  rate = tf.Variable(0.5)
  table = _table(np.zeros((2, 1), np.float32))
  layer = tpu_embedding.TPUEmbedding(E.FeatureConfig(table=table), E.SGD(lambda: rate))

  @tf.function
  def step():
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(layer(tf.constant([0])))
    tape.gradient(loss, layer.trainable_variables)

  step()
  rate.assign(2.0)
  step()
  assert layer.embedding_tables[table].numpy()[0, 0] == -2.5


def test_keras_managed_tables_are_trained_by_the_users_optimizer():
  values = np.arange(6, dtype=np.float32).reshape(3, 2)
  table = _table(values)
  layer = tpu_embedding.TPUEmbedding(
    E.FeatureConfig(table=table), E.Adagrad(0.1), table_updates="keras"
  )
  model = Probe(layer)
  _step(model, tf_keras.optimizers.SGD(0.5), tf.constant([2, 2]), None, tf.ones([2, 2]))
  assert list(layer.variables_by_table["t"]) == ["parameters"]  # no slots
  assert layer.embedding_tables[table] in [v.ref().deref() for v in model.trainable_variables]
  expected = values.copy()
  expected[2] -= 0.5 * 2.0  # Keras SGD on the summed gradient of two occurrences
  np.testing.assert_allclose(layer.embedding_tables[table].numpy(), expected)


def test_unknown_table_updates_mode_is_refused():
  with pytest.raises(ValueError, match="table_updates='tpu'; expected one of"):
    tpu_embedding.TPUEmbedding(
      E.FeatureConfig(table=_table(np.zeros((2, 1)))), "sgd", table_updates="tpu"
    )


@pytest.mark.parametrize(
  "make_optimizer,slot_names",
  [
    (lambda: tf_keras.optimizers.Adam(0.1), ["momenta", "velocities"]),
    (lambda: tf_keras.optimizers.legacy.Ftrl(0.1), ["accumulators", "linears"]),
    (lambda: "adagrad", ["accumulators"]),
  ],
)
def test_translated_optimizer_slots_round_trip_through_a_checkpoint(
  tmp_path, make_optimizer, slot_names
):
  def build():
    table = _table(np.linspace(-1, 1, 8, dtype=np.float32).reshape(4, 2))
    return tpu_embedding.TPUEmbedding(E.FeatureConfig(table=table), make_optimizer())

  trained = build()
  model = Probe(trained)
  for _ in range(2):
    _step(
      model,
      tf_keras.optimizers.SGD(0.0),
      tf.ragged.constant([[0, 3, 3]]),
      None,
      tf.constant([[0.5, -1.0]]),
    )
  path = tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
  fresh = build()
  fresh_model = Probe(fresh)
  fresh_model((tf.ragged.constant([[0]]), None, tf.zeros([1, 2])))
  tf.train.Checkpoint(model=fresh_model).read(path).assert_consumed()
  before = trained.variables_by_table["t"]
  after = fresh.variables_by_table["t"]
  assert sorted(after) == sorted(["parameters"] + slot_names)
  for name in after:
    np.testing.assert_array_equal(after[name].numpy(), before[name].numpy())
  slot = before[slot_names[0]].numpy()
  assert not np.array_equal(slot[0], slot[1])  # row 0 was trained, row 1 was not


# ---------------------------------------------------------------------------------------------
# The forward pass where no tape can record (serving signatures, inference): per occurrence

SERVING_BAGS = {  # feature "a"'s samples (ids, weights) per input kind; a dense id is a sample
  "dense": [([5, 2], None), ([0, 0], None), ([7, 1], None)],
  "ragged": [([5, 2, 5], [2.0, 0.5, 1.5]), ([], []), ([7, 1], [0.25, 4.0])],
  "sparse": [([5, 2, 5], [2.0, 0.5, 1.5]), ([], []), ([7, 1], [0.25, 4.0])],
}


def _serving_case(combiner: str, kind: str, weighted: bool):
  """(layer, features, weights, NumPy activations): feature "a" of `kind` with `combiner`, "b"
  one id per sample on the same table, "s" a sequence (max_sequence_length 2) on another."""
  rng = np.random.default_rng(7)
  t_values = rng.uniform(-1, 1, (8, 3)).astype(np.float32)
  u_values = rng.uniform(-1, 1, (5, 3)).astype(np.float32)
  t, u = _table(t_values, combiner), _table(u_values, combiner, name="u")
  layer = tpu_embedding.TPUEmbedding(
    {
      "a": E.FeatureConfig(table=t, name="a"),
      "b": E.FeatureConfig(table=t, name="b"),
      "s": E.FeatureConfig(table=u, max_sequence_length=2, name="s"),
    },
    E.SGD(0.1),
  )
  bags = SERVING_BAGS[kind]
  ids = tf.ragged.constant([b[0] for b in bags], tf.int64)
  if kind == "dense":  # no combiner and no weights (SPEC §3.4): each id's row
    ids, a_weights, a_want = ids.to_tensor(), None, t_values[[b[0] for b in bags]]
  else:
    a_weights = tf.ragged.constant([b[1] for b in bags], tf.float32)
    if kind == "sparse":
      ids, a_weights = ids.to_sparse(), a_weights.to_sparse()
    a_want = [
      reference.combine_bag(t_values, i, w if weighted else None, combiner) for i, w in bags
    ]
  features = {
    "a": ids,
    "b": tf.constant([3, 5, 3], tf.int64),
    "s": tf.ragged.constant([[1, 3, 2], [4], []], tf.int64),
  }
  weights = {"a": a_weights, "b": None, "s": None} if weighted else None
  want = {
    "a": a_want,
    "b": t_values[[3, 5, 3]],
    "s": [u_values[[1, 3]], [u_values[4], np.zeros(3)], np.zeros([2, 3])],
  }
  return layer, features, weights, want


def _op_types(function: tf.types.experimental.ConcreteFunction) -> list[str]:
  graph = function.graph.as_graph_def()
  return [n.op for n in graph.node] + [n.op for f in graph.library.function for n in f.node_def]


@pytest.mark.parametrize(
  "kind,weighted",
  [("dense", False), ("ragged", False), ("ragged", True), ("sparse", False), ("sparse", True)],
)
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_without_a_tape_the_lookup_gathers_per_occurrence_the_training_activations(
  engine_path, combiner, kind, weighted
):
  layer, features, weights, want = _serving_case(combiner, kind, weighted)
  serve = tf.function(lambda f, w: layer(f, w))

  @tf.function
  def train(f, w):
    with tf.GradientTape():
      return layer(f, w)

  served, trained = serve(features, weights), train(features, weights)
  for name in features:
    np.testing.assert_array_equal(served[name].numpy(), trained[name].numpy())
    np.testing.assert_allclose(served[name].numpy(), np.asarray(want[name]), rtol=1e-6, atol=1e-7)
  serving_ops = _op_types(serve.get_concrete_function(features, weights))
  training_ops = _op_types(train.get_concrete_function(features, weights))
  deduplicating = {"Unique", "TpuEmbeddingDedupLookup"}
  assert not deduplicating & set(serving_ops) and deduplicating & set(training_ops)
  assert serving_ops.count("ResourceGather") == 3  # one per feature, of each of its occurrences
  # The id-range check stays: an id past the table is refused, naming the feature.
  bad = dict(features, b=tf.constant([3, 8, 3], tf.int64))
  with pytest.raises(
    tf.errors.InvalidArgumentError, match=r"Feature \\'b\\' \(table.*Offending ids:\] \[8\]"
  ):
    serve(bad, weights)


@pytest.mark.parametrize("traced_under_the_tape", [False, True])
def test_a_tf_function_differentiated_by_a_tape_outside_it_updates_the_tables(
  engine_path, traced_under_the_tape
):
  """TF differentiates such a function with a backward function of its own, which runs only
  what its outputs need: the update must be among it (it once was pruned, tables unchanged)."""
  values = np.arange(20, dtype=np.float32).reshape(10, 2) / 10
  table = _table(values)
  layer = tpu_embedding.TPUEmbedding({"f": E.FeatureConfig(table=table, name="f")}, E.SGD(0.5))
  ids = tf.constant([1, 3, 1], tf.int64)
  layer({"f": ids})  # builds the tables outside the function
  lookup = tf.function(lambda ids: tf.reduce_sum(layer({"f": ids})["f"]))
  if not traced_under_the_tape:
    lookup.get_concrete_function(tf.TensorSpec([None], tf.int64))  # no tape records here
  with tf.GradientTape() as tape:
    loss = lookup(ids)
  tape.gradient(loss, layer.trainable_variables)
  rows, grads = reference.assemble_gradients(
    [([1], None), ([3], None), ([1], None)], np.ones([3, 2]), "sum"
  )
  want = values.astype(np.float64)
  want[rows] -= 0.5 * grads
  np.testing.assert_allclose(layer.embedding_tables[table].numpy(), want, rtol=1e-6)
  assert lookup.experimental_get_tracing_count() == 1


def test_a_function_traced_without_a_tape_can_still_be_differentiated():
  """Its per-occurrence forward gives the backward pass no deduplication: the backward builds
  its own (`TableLookup.for_update`) instead of failing."""
  layer, features, weights, _ = _serving_case("mean", "ragged", True)
  layer(features, weights)  # builds the tables, so that the function is traced once
  traced = tf.function(lambda: sum(tf.reduce_sum(a) for a in layer(features, weights).values()))
  traced()  # traced here, where no tape records: the per-occurrence forward
  with tf.GradientTape() as tape:
    loss = traced()
  assert traced.experimental_get_tracing_count() == 1
  (trap_gradient,) = tape.gradient(loss, layer.trainable_variables)
  assert float(tf.reduce_sum(tf.abs(trap_gradient))) == 0.0
