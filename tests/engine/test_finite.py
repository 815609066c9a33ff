"""Tests of `tpu_embedding.engine.finite`: TPUEmbedding(check_finite=True) stops NaN/Inf before a
table; by default they poison the touched rows, as on TPU. Both engine paths (compiled kernels and
TF ops) must agree on what they accept.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tpu_embedding
import tpu_embedding.keras as keras3_layers
from tpu_embedding import backends, hardware
from tpu_embedding import config as config_lib

from unchanged import assert_unchanged, snapshot

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


def two_tables(optimizer_b, pipelining=False, check_finite=True):
  """Tables 'ta' (SGD 0.5) and 'tb' (`optimizer_b`), both starting at ROWS."""
  table = lambda name, optimizer: E.TableConfig(
    5, 2, name=name, combiner="sum", initializer=tf.constant_initializer(ROWS), optimizer=optimizer
  )
  return tpu_embedding.TPUEmbedding(
    {"a": E.FeatureConfig(table("ta", E.SGD(0.5))), "b": E.FeatureConfig(table("tb", optimizer_b))},
    check_finite=check_finite,
    pipeline_execution_with_tensor_core=pipelining,
  )


def step_of(model, scale=1.0):
  """One training step of both features (rows 1 and 3), feature 'b's gradient scaled."""
  ids = tf.constant([1, 3], tf.int64)

  def step():
    with tf.GradientTape() as tape:
      out = model({"a": ids, "b": ids})
      loss = tf.reduce_sum(out["a"]) + tf.reduce_sum(out["b"]) * scale
    tape.gradient(loss, model.trainable_variables)

  return step


def train_both(model, scale=1.0, traced=False):
  step = step_of(model, scale)
  (tf.function(step) if traced else step)()


@pytest.mark.parametrize("traced", [False, True])
def test_a_step_refused_for_one_table_writes_no_other_table(engine_path, traced):
  model = two_tables(E.SGD(learning_rate=lambda: float("nan")))
  model.build(None)
  before = snapshot(model)
  with pytest.raises(
    tf.errors.InvalidArgumentError,
    match="Table 'tb': its learning rate is not finite .*this step wrote nothing to any table",
  ):
    train_both(model, traced=traced)
  assert_unchanged(before, model)


@pytest.mark.parametrize("traced", [False, True])
def test_an_update_that_would_overflow_a_slot_is_refused_before_any_write(engine_path, traced):
  # Finite gradients of 1e25: Adagrad's accumulator 0.1 + 1e50 overflows float32 to inf, which
  # would freeze the rows forever (W - lr * g / sqrt(inf) = W).
  model = two_tables(E.Adagrad(0.1))
  model.build(None)
  before = snapshot(model)
  with pytest.raises(
    tf.errors.InvalidArgumentError,
    match="Table 'tb': this step's update would write a non-finite value to its "
    "'accumulators' slot",
  ):
    train_both(model, scale=1e25, traced=traced)
  assert_unchanged(before, model)
  train_both(model, traced=traced)  # finite steps still train both tables
  expected = ROWS.copy()
  expected[[1, 3]] -= 0.5
  np.testing.assert_array_equal(model.variables_by_table["ta"]["parameters"].numpy(), expected)


def test_a_held_update_that_would_overflow_is_refused_before_any_write(engine_path):
  model = two_tables(E.Adagrad(0.1), pipelining=True)
  train_both(model, scale=1e25)  # held, not applied yet: its gradients are finite
  before = snapshot(model)
  with pytest.raises(
    tf.errors.InvalidArgumentError,
    match="Table 'tb': this step's update would write a non-finite value to its "
    "'accumulators' slot",
  ):
    train_both(model)
  assert_unchanged(before, model)
  with pytest.raises(tf.errors.InvalidArgumentError, match="Table 'tb': this step's update"):
    model.flush()  # as before a checkpoint: the held update is checked there too
  assert_unchanged(before, model)


def test_under_mirrored_strategy_a_refused_step_writes_no_table():
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  with strategy.scope():
    model = two_tables(E.SGD(learning_rate=lambda: float("nan")))
    model.build(None)
  before = snapshot(model)
  step = step_of(model)

  with pytest.raises(tf.errors.InvalidArgumentError, match="Table 'tb': its learning rate"):
    tf.function(lambda: strategy.run(step))()
  assert_unchanged(before, model)


@pytest.mark.parametrize("compiled", ["graph", "xla"])
def test_a_step_training_a_table_without_optimizer_writes_no_other_table(compiled):
  table = lambda name, optimizer: E.TableConfig(
    5, 2, name=name, initializer=tf.constant_initializer(ROWS), optimizer=optimizer
  )
  model = tpu_embedding.TPUEmbedding(
    {"a": E.FeatureConfig(table("ta", E.SGD(0.5))), "b": E.FeatureConfig(table("tb", None))},
    optimizer=None,
  )
  model.build(None)
  before = snapshot(model)
  step = step_of(model)

  error = ValueError if compiled == "xla" else tf.errors.InvalidArgumentError
  # Assert's message escapes the quotes.
  with pytest.raises(
    error, match=r"(?s)Table \\?'tb\\?' has no optimizer.*This step wrote nothing"
  ):
    tf.function(step, jit_compile=compiled == "xla")()
  assert_unchanged(before, model)


@pytest.mark.parametrize("rows", [5, 1 << 20])  # small: tf.Variable; large: assigned in a function
def test_an_initializer_producing_nan_is_refused_at_creation_naming_the_table(rows):
  initializer = lambda shape, dtype: tf.fill(shape, float("nan"))
  table = E.TableConfig(rows, 4, name="videos", initializer=initializer)
  model = tpu_embedding.TPUEmbedding({"f": E.FeatureConfig(table)}, "sgd", check_finite=True)
  with pytest.raises(
    tf.errors.InvalidArgumentError,
    match="Embedding variable 'videos': its initializer produced a non-finite value",
  ):
    model.build(None)
  assert not model.variables  # nothing was created


@pytest.mark.parametrize("check_finite", [False, True])
def test_a_float16_activation_path_whose_gradient_overflows(engine_path, check_finite):
  # 300 * 300 = 90,000 overflows float16 (max 65,504): the gradient reaching the activations is
  # inf. By default it poisons the touched rows as on TPU; check_finite refuses the whole step.
  model = two_tables(E.SGD(0.5), check_finite=check_finite)
  model.build(None)
  before = snapshot(model)
  ids = tf.constant([1, 3], tf.int64)

  def step():
    with tf.GradientTape() as tape:
      out = model({"a": ids, "b": ids})
      half = tf.cast(out["b"], tf.float16) * tf.constant(300, tf.float16)
      loss = tf.reduce_sum(out["a"]) + tf.cast(
        tf.reduce_sum(half * tf.constant(300, tf.float16)), tf.float32
      )
    tape.gradient(loss, model.trainable_variables)

  if not check_finite:
    step()
    table_b = model.variables_by_table["tb"]["parameters"].numpy()
    assert (table_b[[1, 3]] == -np.inf).all()
    np.testing.assert_array_equal(table_b[[0, 2, 4]], ROWS[[0, 2, 4]])
    return
  with pytest.raises(
    tf.errors.InvalidArgumentError,
    match="Feature 'b' \\(table 'tb'\\): the gradient of its activations holds a non-finite",
  ):
    step()
  assert_unchanged(before, model)


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


def partial_two_sides(refused, layer_class=tpu_embedding.PartialTPUEmbedding):
  """'ta' (5 rows) replicated, 'tb' (50 rows) sharded, each side its own engine; the table
  `refused` has a NaN learning rate, the other SGD 0.5; every row starts at 0.25."""
  table = lambda name, rows: E.TableConfig(
    rows,
    2,
    name=name,
    combiner="sum",
    initializer=tf.constant_initializer(0.25),
    optimizer=E.SGD(learning_rate=(lambda: float("nan")) if name == refused else 0.5),
  )
  model = layer_class(
    {"a": E.FeatureConfig(table("ta", 5)), "b": E.FeatureConfig(table("tb", 50))},
    size_threshold=20,
    check_finite=True,
  )
  assert [model.side(t) for t in ("ta", "tb")] == ["replicated", "sharded"]
  model.build(None)
  return model


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("refused", ["ta", "tb"])
@pytest.mark.parametrize("flavour", ["tf_keras", "keras3"])
def test_partial_a_step_refused_on_one_side_writes_no_table_of_the_other(traced, refused, flavour):
  layer_class = {
    "tf_keras": tpu_embedding.PartialTPUEmbedding,
    "keras3": keras3_layers.PartialTPUEmbedding,
  }[flavour]
  model = partial_two_sides(refused, layer_class)
  before = snapshot(model)
  with pytest.raises(
    tf.errors.InvalidArgumentError,
    match=f"Table '{refused}': its learning rate is not finite .*this step wrote nothing",
  ):
    train_both(model, traced=traced)
  assert_unchanged(before, model)


def test_partial_under_mirrored_strategy_a_step_refused_on_one_side_writes_no_table():
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  for refused in ("ta", "tb", None):
    with strategy.scope():
      model = partial_two_sides(refused)
    before = snapshot(model)
    step = tf.function(lambda: strategy.run(step_of(model)))
    if refused is None:  # both sides train: each row 1 and 3 gets 2 replicas x gradient 1
      step()
      for name in ("ta", "tb"):
        rows = model.variables_by_table[name]["parameters"].numpy()
        np.testing.assert_array_equal(rows[[1, 3]], np.full((2, 2), 0.25 - 0.5 * 2))
      continue
    with pytest.raises(tf.errors.InvalidArgumentError, match=f"Table '{refused}': its learning"):
      step()
    assert_unchanged(before, model)


@pytest.mark.parametrize("tables", [{"a": 5, "b": 50}, {"a": 5}], ids=["two_sides", "one_side"])
def test_partial_runs_each_check_once(tables):
  """The joint step runs both sides' checks before either writes; the engines then skip their
  own (they once ran every check twice), and with one side it adds nothing."""
  config = {
    name: E.FeatureConfig(E.TableConfig(rows, 2, name=f"t{name}", combiner="sum"))
    for name, rows in tables.items()
  }
  model = tpu_embedding.PartialTPUEmbedding(
    config, E.SGD(0.5), size_threshold=20, check_finite=True
  )
  ids = {name: tf.constant([1, 3], tf.int64) for name in tables}
  model(ids)

  @tf.function
  def step():
    with tf.GradientTape() as tape:
      loss = sum(tf.reduce_sum(a) for a in model(ids).values())
    tape.gradient(loss, model.trainable_variables)

  graph = step.get_concrete_function().graph.as_graph_def()
  nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
  messages = [n.attr["message"].s.decode() for n in nodes if n.op == "CheckNumerics"]
  wanted = []
  for name in tables:
    wanted += [
      f"Feature '{name}' (table 't{name}'): the gradient of its activations",
      f"Table 't{name}': its learning rate is not finite",
      f"Table 't{name}': the gradient summed over one of its rows",
      f"Table 't{name}': this step's update would write a non-finite value to its rows",
    ]
  assert sorted(m for w in wanted for m in messages if m.startswith(w)) == sorted(messages)
  assert [sum(m.startswith(w) for m in messages) for w in wanted] == [1] * len(wanted)
