"""Wiring tests of the TPU backends (tpu_embedding.backends) through the layer.

There is no TPU here. Every test in this file replaces `backends.mid_level` (the
`tf.tpu.experimental.embedding` namespace) with recording fakes of `TPUEmbeddingV0`,
`TPUEmbedding` and `TPUEmbeddingV2`, and patches `hardware.detect_embedding_feature` so that the
strategy in scope (the default one, or a CPU strategy) reports a TPU embedding feature. They
check what the layer asks of the mid-level API (which class, which arguments, which calls in
which order, which gradients), never that anything runs on a TPU.
"""

import inspect
import types

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tpu_embedding import backends
from tpu_embedding import hardware
from tpu_embedding import optimizers
from tpu_embedding.hardware import EmbeddingFeature, Path
from tpu_embedding.layer import TPUEmbedding

emb = tf.tpu.experimental.embedding
BATCH = 4
TRAP = "tpu_embedding_helper_dummy"
# Per-feature loss weights: loss = sum_k W[k] * sum(activations[k]), so d loss / d activation
# of feature k is W[k] everywhere; distinct values show gradients are not mixed up.
LOSS_WEIGHTS = {"favorited": 3.0, "friends": 5.0, "watched": 2.0}


# --------------------------------------------------------------------------------------------
# Recording fakes of the mid-level classes


class Log:
  """Every call made on any fake, in order: (class name, method, arguments by name)."""

  def __init__(self):
    self.calls = []
    self.instances = []

  def record(self, who, method, arguments):
    self.calls.append((who, method, arguments))

  def methods(self, who=None):
    return [m for w, m, _ in self.calls if who is None or w == who]

  def args(self, method):
    found = [a for _, m, a in self.calls if m == method]
    assert len(found) == 1, (method, self.methods())
    return found[0]


def _output_shapes(feature_config, input_shapes=None, batch_size=None):
  """Per-feature activation shape without D, following SPEC 3.6 in its simple cases."""
  shapes = []
  flat_inputs = tf.nest.flatten(input_shapes) if input_shapes is not None else None
  for i, feature in enumerate(tf.nest.flatten(feature_config)):
    if feature.output_shape.rank is not None:
      shapes.append(feature.output_shape.as_list())
    elif flat_inputs is not None:
      shape = tf.TensorShape(flat_inputs[i])
      shapes.append(shape.as_list() if shape.rank == 1 else shape[:-1].as_list())
    else:
      shapes.append([batch_size])
  return shapes


def make_fakes():
  """A stand-in for `tf.tpu.experimental.embedding` whose three classes record into a Log."""
  log = Log()

  class _Fake(tf.Module):
    who = None

    def __init__(self, *args, **kwargs):
      super().__init__(name=type(self).who)
      real = getattr(emb, type(self).who)
      bound = inspect.signature(real.__init__).bind(self, *args, **kwargs)
      bound.apply_defaults()
      arguments = dict(bound.arguments)
      del arguments["self"]
      log.record(type(self).who, "__init__", arguments)
      log.instances.append(self)
      self._feature_config = self._no_dependency(arguments["feature_config"])
      self._tables = {}  # table name -> variable, tracked as the real classes track them
      # Gradients received by apply_gradients, kept in variables so that values can be read
      # after a tf.function has run as well as eagerly.
      self.received = self._no_dependency({})

    def _features(self):
      return tf.nest.flatten(self._feature_config)

    def _create_tables(self, trainable):
      with tf.init_scope():
        for feature in self._features():
          table = feature.table
          if table.name not in self._tables:
            self._tables[table.name] = tf.Variable(
                table.initializer([table.vocabulary_size, table.dim], dtype=tf.float32),
                trainable=trainable, name=table.name)

    @property
    def embedding_tables(self):
      return {f.table: self._tables[f.table.name] for f in self._features()}

    def _fill(self, shapes):
      """Activation k (in flatten order) is filled with k + 1."""
      flat = [tf.fill(shape + [f.table.dim], float(k + 1))
              for k, (shape, f) in enumerate(zip(shapes, self._features()))]
      return tf.nest.pack_sequence_as(self._feature_config, flat)

    def _receive(self, gradients):
      tf.nest.assert_same_structure(self._feature_config, gradients)
      for path, gradient in zip(_paths(self._feature_config), tf.nest.flatten(gradients)):
        if path not in self.received:
          with tf.init_scope():
            self.received[path] = tf.Variable(tf.zeros(gradient.shape), trainable=False)
        self.received[path].assign(gradient)

  class TPUEmbeddingV0(_Fake):
    who = "TPUEmbeddingV0"

    def build(self):
      log.record(self.who, "build", {})
      self._create_tables(trainable=True)

    def __call__(self, features, weights=None):
      log.record(self.who, "__call__", {"features": features, "weights": weights})
      # A real lookup on the (trainable) tables, so that the Keras optimizer has work to do.
      return emb.serving_embedding_lookup(features, weights, self.embedding_tables,
                                          self._feature_config)

  class TPUEmbedding(_Fake):
    who = "TPUEmbedding"

    def build(self, per_replica_input_shapes=None, per_replica_batch_size=None):
      log.record(self.who, "build", {"per_replica_input_shapes": per_replica_input_shapes,
                                     "per_replica_batch_size": per_replica_batch_size})
      self._shapes = self._no_dependency(_output_shapes(
          self._feature_config, per_replica_input_shapes, per_replica_batch_size))
      self._create_tables(trainable=False)

    def enqueue(self, features, weights=None, training=True, name=None, device=None):
      log.record(self.who, "enqueue", {"features": features, "weights": weights,
                                       "training": training, "name": name, "device": device})

    def dequeue(self, name=None):
      log.record(self.who, "dequeue", {"name": name})
      return self._fill(self._shapes)

    def apply_gradients(self, gradients, name=None):
      log.record(self.who, "apply_gradients", {"gradients": gradients, "name": name})
      self._receive(gradients)

  class TPUEmbeddingV2(_Fake):
    """Like the real class, keys `embedding_tables` by stacked table name; tables of the same
    dim share a stack unless stacking is disabled."""

    who = "TPUEmbeddingV2"

    def build(self):
      log.record(self.who, "build", {})
      self._create_tables(trainable=False)

    @property
    def embedding_layouts(self):
      config = log.args("__init__")["sparse_core_embedding_config"]
      stack_apart = config is not None and config.disable_table_stacking
      tables = {f.table.name: f.table for f in self._features()}
      by_dim = {}
      for name, table in tables.items():
        by_dim.setdefault(table.dim, []).append(name)
      return {name: types.SimpleNamespace(
                  stacked_table_name=name if stack_apart else "_".join(by_dim[table.dim]))
              for name, table in tables.items()}

    @property
    def embedding_tables(self):
      return {layout.stacked_table_name: self._tables[name]  # one member stands for the stack
              for name, layout in self.embedding_layouts.items()}

    def __call__(self, features, weights=None):
      preserved = {"stacked_table": tf.constant([7, 8])}
      log.record(self.who, "__call__",
                 {"features": features, "weights": weights, "preserved": preserved})
      return self._fill(_output_shapes(self._feature_config)), preserved

    def apply_gradients(self, gradients, preserved_outputs):
      log.record(self.who, "apply_gradients",
                 {"gradients": gradients, "preserved_outputs": preserved_outputs})
      self._receive(gradients)

  namespace = types.SimpleNamespace(TPUEmbeddingV0=TPUEmbeddingV0, TPUEmbedding=TPUEmbedding,
                                    TPUEmbeddingV2=TPUEmbeddingV2)
  return namespace, log


def _paths(nest):
  if isinstance(nest, dict):
    return sorted(nest)
  return list(range(len(tf.nest.flatten(nest))))


CLASS_OF = {Path.TPU_V0: "TPUEmbeddingV0", Path.TPU_V1: "TPUEmbedding",
            Path.TPU_V2: "TPUEmbeddingV2"}
FEATURE_OF = {Path.TPU_V0: EmbeddingFeature.UNSUPPORTED, Path.TPU_V1: EmbeddingFeature.V1,
              Path.TPU_V2: EmbeddingFeature.V2}


@pytest.fixture
def tpu(monkeypatch):
  """`tpu(path)` makes the strategy in scope look like that TPU and returns the call log."""

  def install(path):
    namespace, log = make_fakes()
    monkeypatch.setattr(backends, "mid_level", namespace)
    if path is not Path.CPU:
      feature = FEATURE_OF[path]
      monkeypatch.setattr(hardware, "detect_embedding_feature", lambda strategy: feature)
    return log

  return install


# --------------------------------------------------------------------------------------------
# The configuration and data of tf-recommenders' own layer test


def tables():
  video = emb.TableConfig(vocabulary_size=2, dim=4, combiner="sum", name="video_table",
                          initializer=tf.constant_initializer(np.arange(8.0)))
  user = emb.TableConfig(vocabulary_size=4, dim=2, combiner="mean", name="user_table",
                         initializer=tf.constant_initializer(np.arange(8.0)))
  return video, user


def feature_config(output_shape=None):
  video, user = tables()
  return {
      "watched": emb.FeatureConfig(table=video, name="watched", output_shape=output_shape),
      "favorited": emb.FeatureConfig(table=video, name="favorited", output_shape=output_shape),
      "friends": emb.FeatureConfig(table=user, name="friends", output_shape=output_shape),
  }


def features():
  ragged = lambda values, lengths: tf.RaggedTensor.from_row_lengths(
      tf.constant(values, tf.int32), lengths)
  return {
      "watched": ragged([0, 0, 1, 0, 1, 1], [1, 2, 2, 1]),
      "favorited": ragged([0, 1, 1, 0, 0, 1], [2, 1, 1, 2]),
      "friends": ragged([3, 0, 1, 2, 3, 0, 1, 2], [1, 3, 1, 3]),
  }


def make_layer(path, **kwargs):
  kwargs.setdefault("optimizer", tf_keras.optimizers.legacy.SGD(learning_rate=0.1))
  # SC-API requires output_shape (SPEC 3.6); the others derive it from the inputs.
  config = feature_config([BATCH] if path is Path.TPU_V2 else None)
  return TPUEmbedding(config, **kwargs), config


def _loss(activations):
  return tf.add_n([LOSS_WEIGHTS[k] * tf.reduce_sum(a) for k, a in activations.items()])


class _Model(tf_keras.Model):
  def __init__(self, layer):
    super().__init__()
    self.embedding = layer

  def call(self, inputs):
    return self.embedding(inputs)


def train_step(model, optimizer, inputs, compiled):
  """One step as users write it; returns {variable name: gradient}."""

  def step(inputs):
    with tf.GradientTape() as tape:
      loss = _loss(model(inputs))
    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return gradients

  gradients = (tf.function(step) if compiled else step)(inputs)
  return {v.name: g for v, g in zip(model.trainable_variables, gradients)}


# --------------------------------------------------------------------------------------------
# Construction: which class, which arguments


def test_fakes_take_the_real_method_signatures():
  """Guards the fakes themselves: their methods take the real classes' parameters."""
  # The constructors are bound against the real signatures inside the fakes themselves.
  namespace, _ = make_fakes()
  for name in ("TPUEmbeddingV0", "TPUEmbedding", "TPUEmbeddingV2"):
    fake = inspect.signature(getattr(namespace, name).build).parameters
    real = inspect.signature(getattr(emb, name).build).parameters
    assert list(fake) == list(real), name
  for name in ("enqueue", "dequeue", "apply_gradients"):
    assert (list(inspect.signature(getattr(namespace.TPUEmbedding, name)).parameters)
            == list(inspect.signature(getattr(emb.TPUEmbedding, name)).parameters)), name
  assert (list(inspect.signature(namespace.TPUEmbeddingV2.apply_gradients).parameters)
          == list(inspect.signature(emb.TPUEmbeddingV2.apply_gradients).parameters))


@pytest.mark.parametrize("path", [Path.TPU_V0, Path.TPU_V1, Path.TPU_V2])
def test_each_tpu_path_builds_its_mid_level_class_from_the_cloned_config(tpu, path):
  """Wiring only (fakes, no TPU): the right fake is constructed once with the prepared config."""
  log = tpu(path)
  layer, user_config = make_layer(path)
  assert layer.path is path
  assert log.methods() == ["__init__"]
  assert [w for w, _, _ in log.calls] == [CLASS_OF[path]]
  assert layer._tpu_embedding is log.instances[0]
  arguments = log.args("__init__")

  # The cloned nest: same structure, never the user's objects, tables shared as the user shared.
  given = arguments["feature_config"]
  assert given is layer._config.feature_config
  tf.nest.assert_same_structure(user_config, given)
  for key in user_config:
    assert given[key] is not user_config[key]
    assert given[key].table is not user_config[key].table
    assert given[key].table.name == user_config[key].table.name
    assert given[key].name == user_config[key].name
  assert given["watched"].table is given["favorited"].table
  assert user_config["watched"].table.optimizer is None  # the user's config is untouched

  # The normalised optimizer: the Keras SGD(0.1) as a mid-level SGD.
  optimizer = arguments["optimizer"]
  assert optimizer is layer._config.optimizer
  assert isinstance(optimizer, emb.SGD)
  assert float(optimizers.learning_rate_tensor(optimizer)) == pytest.approx(0.1)
  assert given["watched"].table.optimizer is optimizer


@pytest.mark.parametrize("pipelining", [False, True])
def test_v1_receives_the_pipelining_flag(tpu, pipelining):
  """Wiring only (fakes, no TPU): the flag reaches TPUEmbedding's third parameter."""
  log = tpu(Path.TPU_V1)
  make_layer(Path.TPU_V1, pipeline_execution_with_tensor_core=pipelining)
  assert log.args("__init__")["pipeline_execution_with_tensor_core"] is pipelining


@pytest.mark.parametrize("pipelining", [False, True])
def test_v2_receives_pipelining_and_the_sparse_core_config(tpu, pipelining):
  """Wiring only (fakes, no TPU): both reach TPUEmbeddingV2 unchanged."""
  log = tpu(Path.TPU_V2)
  sc_config = emb.SparseCoreEmbeddingConfig(max_ids_per_chip_per_sample=32)
  make_layer(Path.TPU_V2, pipeline_execution_with_tensor_core=pipelining,
             sparse_core_embedding_config=sc_config)
  arguments = log.args("__init__")
  assert arguments["pipeline_execution_with_tensor_core"] is pipelining
  assert arguments["sparse_core_embedding_config"] is sc_config


def test_a_string_optimizer_reaches_the_mid_level_api_normalised(tpu):
  """Wiring only (fakes, no TPU): 'adagrad' arrives as a mid-level Adagrad."""
  log = tpu(Path.TPU_V1)
  make_layer(Path.TPU_V1, optimizer="adagrad")
  assert type(log.args("__init__")["optimizer"]) is emb.Adagrad


def test_the_cpu_path_constructs_no_mid_level_object(tpu):
  """Wiring only (fakes, no TPU): off TPU no mid-level class is ever constructed or called."""
  log = tpu(Path.CPU)
  layer, _ = make_layer(Path.CPU)
  layer(features())
  assert layer.path is Path.CPU
  assert log.calls == []


def test_forcing_unsupported_on_a_v1_tpu_builds_v0(tpu):
  """Wiring only (fakes, no TPU): the override picks TPUEmbeddingV0."""
  log = tpu(Path.TPU_V1)
  layer, _ = make_layer(Path.TPU_V1, embedding_feature=EmbeddingFeature.UNSUPPORTED)
  assert layer.path is Path.TPU_V0
  assert [w for w, _, _ in log.calls] == ["TPUEmbeddingV0"]


# --------------------------------------------------------------------------------------------
# build


def test_v1_build_gets_the_layers_input_shapes(tpu):
  """Wiring only (fakes, no TPU): the V1 fake's build sees the nest of shapes Keras gives the
  layer."""
  log = tpu(Path.TPU_V1)
  layer, _ = make_layer(Path.TPU_V1)
  inputs = features()
  layer(inputs)
  shapes = log.args("build")["per_replica_input_shapes"]
  assert log.args("build")["per_replica_batch_size"] is None
  tf.nest.assert_same_structure(inputs, shapes, check_types=False)
  for key, tensor in inputs.items():
    assert tf.TensorShape(shapes[key]).as_list() == tensor.shape.as_list() == [BATCH, None]


def test_v1_build_from_a_functional_model_gets_the_input_specs(tpu):
  """Wiring only (fakes, no TPU): build sees the shapes of the Keras Inputs."""
  log = tpu(Path.TPU_V1)
  layer, _ = make_layer(Path.TPU_V1)
  inputs = {k: tf_keras.Input(batch_size=BATCH, shape=(None,), ragged=True, dtype=tf.int32,
                              name=k) for k in LOSS_WEIGHTS}
  tf_keras.Model(inputs, layer(inputs))
  shapes = log.args("build")["per_replica_input_shapes"]
  for key in LOSS_WEIGHTS:
    assert tf.TensorShape(shapes[key]).as_list() == [BATCH, None]


def test_v1_build_uses_the_batch_size_when_given(tpu):
  """Wiring only (fakes, no TPU): batch_size= goes to per_replica_batch_size."""
  log = tpu(Path.TPU_V1)
  layer, _ = make_layer(Path.TPU_V1, batch_size=BATCH)
  layer(features())
  assert log.args("build") == {"per_replica_input_shapes": None,
                               "per_replica_batch_size": BATCH}


@pytest.mark.parametrize("path", [Path.TPU_V0, Path.TPU_V2])
def test_v0_and_v2_build_without_arguments(tpu, path):
  """Wiring only (fakes, no TPU): these classes' build() takes no shapes."""
  log = tpu(path)
  layer, _ = make_layer(path)
  layer(features())
  assert log.args("build") == {}
  assert log.methods()[:2] == ["__init__", "build"]


# --------------------------------------------------------------------------------------------
# One training step


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
def test_v1_training_step_enqueues_dequeues_and_applies_in_order(tpu, compiled):
  """Wiring only (fakes, no TPU): enqueue -> dequeue -> apply_gradients, one name, right
  gradients."""
  log = tpu(Path.TPU_V1)
  layer, _ = make_layer(Path.TPU_V1)
  model = _Model(layer)
  inputs = features()
  gradients = train_step(model, tf_keras.optimizers.legacy.SGD(0.1), inputs, compiled)

  for enqueue, dequeue, apply in _steps(log, ["enqueue", "dequeue", "apply_gradients"],
                                        compiled):
    assert enqueue["training"] is True
    assert enqueue["weights"] is None
    tf.nest.assert_same_structure(inputs, enqueue["features"], expand_composites=False)
    assert enqueue["name"]
    assert dequeue["name"] == enqueue["name"]
    assert apply["name"] == enqueue["name"]
  _check_gradients(layer, log, gradients)


def _steps(log, step_methods, compiled):
  """The calls of each traced step, checked to be exactly `step_methods` in that order.

  Eagerly there is one step. A tf.function that creates variables on its first trace (the Keras
  optimizer's slots, the layer's trap) is traced twice, so each trace is one repetition.
  """
  methods = log.methods()
  assert methods[:2] == ["__init__", "build"], methods
  repeats, rest = divmod(len(methods) - 2, len(step_methods))
  assert rest == 0 and (repeats == 1 or compiled and repeats >= 1), methods
  assert methods[2:] == step_methods * repeats, methods
  arguments = [a for _, _, a in log.calls[2:]]
  return [arguments[i:i + len(step_methods)] for i in range(0, len(arguments), len(step_methods))]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
def test_v2_training_step_calls_then_applies_with_the_preserved_outputs(tpu, compiled):
  """Wiring only (fakes, no TPU): __call__ -> apply_gradients(gradients, preserved_outputs=what
  __call__ gave)."""
  log = tpu(Path.TPU_V2)
  layer, _ = make_layer(Path.TPU_V2)
  model = _Model(layer)
  gradients = train_step(model, tf_keras.optimizers.legacy.SGD(0.1), features(), compiled)

  for call, apply in _steps(log, ["__call__", "apply_gradients"], compiled):
    assert call["weights"] is None
    assert apply["preserved_outputs"] is call["preserved"]
  _check_gradients(layer, log, gradients)


def _check_gradients(layer, log, gradients):
  fake = log.instances[0]
  for _, method, arguments in log.calls:
    if method == "apply_gradients":
      tf.nest.assert_same_structure(layer._config.feature_config, arguments["gradients"])
  for key, weight in LOSS_WEIGHTS.items():
    dim = layer._config.feature_config[key].table.dim
    received = fake.received[key].numpy()
    assert received.shape == (BATCH, dim), key
    np.testing.assert_array_equal(received, np.full((BATCH, dim), weight), err_msg=key)
  trap = [name for name in gradients if TRAP in name]
  assert len(trap) == 1, list(gradients)
  np.testing.assert_array_equal(gradients[trap[0]].numpy(), [0.0])
  np.testing.assert_array_equal(getattr(layer, TRAP).numpy(), [0.0])
  assert len(gradients) == 1  # the trap is the layer's only trainable variable on V1/V2


def test_each_call_of_a_step_gets_its_own_name(tpu):
  """Wiring only (fakes, no TPU): two calls in one step pair their own enqueue/dequeue/apply by
  name."""
  log = tpu(Path.TPU_V1)
  layer, _ = make_layer(Path.TPU_V1)
  inputs = features()
  with tf.GradientTape() as tape:
    loss = _loss(layer(inputs)) + _loss(layer(inputs))
  tape.gradient(loss, layer.trainable_variables)
  names = {m: [a["name"] for _, mm, a in log.calls if mm == m]
           for m in ("enqueue", "dequeue", "apply_gradients")}
  assert len(set(names["enqueue"])) == 2
  assert sorted(names["enqueue"]) == sorted(names["dequeue"]) == sorted(names["apply_gradients"])
  first, second = names["enqueue"]
  order = [(m, a["name"]) for _, m, a in log.calls if m != "build" and m != "__init__"]
  assert order.index(("enqueue", first)) < order.index(("dequeue", first))
  assert order.index(("enqueue", second)) < order.index(("dequeue", second))


def test_evaluation_without_a_tape_enqueues_for_training_but_applies_nothing(tpu):
  """Wiring only (fakes, no TPU): enqueue always says training=True (as tf-recommenders); a
  step without gradients applies none."""
  log = tpu(Path.TPU_V1)
  layer, _ = make_layer(Path.TPU_V1)
  layer(features())
  assert log.methods() == ["__init__", "build", "enqueue", "dequeue"]
  assert log.args("enqueue")["training"] is True


def test_v0_tables_are_trainable_variables_trained_by_the_keras_optimizer(tpu):
  """Wiring only (fakes, no TPU): on V0 the replicated tables are the layer's trainable
  variables (no trap), updated by the user's Keras optimizer."""
  log = tpu(Path.TPU_V0)
  layer, user_config = make_layer(Path.TPU_V0)
  model = _Model(layer)
  inputs = features()
  gradients = train_step(model, tf_keras.optimizers.legacy.SGD(0.5), inputs, compiled=False)

  assert log.methods() == ["__init__", "build", "__call__"]
  fake = log.instances[0]
  table_vars = list(fake.embedding_tables.values())
  assert len(table_vars) == 2
  trainable = layer.trainable_variables
  assert len(trainable) == 2
  assert {v.ref() for v in trainable} == {v.ref() for v in table_vars}
  assert not hasattr(layer, TRAP)
  assert all(TRAP not in name for name in gradients)
  assert set(layer.embedding_tables) == {user_config["watched"].table,
                                        user_config["friends"].table}

  # SGD(0.5) on loss = sum_k w_k * sum(act_k): video is a sum table, so each occurrence of a
  # row in watched/favorited adds w_k to each of its dims; user is a mean table over bags of
  # lengths [1, 3, 1, 3], so a row in a bag of length n gets w / n.
  video = np.arange(8.0).reshape(2, 4)
  video_grad = np.zeros(2)
  for key in ("watched", "favorited"):
    for row in inputs[key].flat_values.numpy():
      video_grad[row] += LOSS_WEIGHTS[key]
  user = np.arange(8.0).reshape(4, 2)
  user_grad = np.zeros(4)
  for bag in inputs["friends"].to_list():
    for row in bag:
      user_grad[row] += LOSS_WEIGHTS["friends"] / len(bag)
  tables_by_name = {t.name: v for t, v in layer.embedding_tables.items()}
  np.testing.assert_allclose(tables_by_name["video_table"].numpy(),
                             video - 0.5 * video_grad[:, None], rtol=1e-6)
  np.testing.assert_allclose(tables_by_name["user_table"].numpy(),
                             user - 0.5 * user_grad[:, None], rtol=1e-6)


def test_v2_tables_are_keyed_by_the_users_table_configs(tpu):
  """Wiring only (fakes, no TPU): TPUEmbeddingV2 keys its tables by stacked name; the layer
  maps them back to the user's TableConfigs."""
  tpu(Path.TPU_V2)
  layer, user_config = make_layer(Path.TPU_V2)
  layer(features())
  tables = layer.embedding_tables
  video, user = user_config["watched"].table, user_config["friends"].table
  assert set(tables) == {video, user}
  assert tables[video].shape == (2, 4) and tables[user].shape == (4, 2)


def _same_dim_config():
  a = emb.TableConfig(vocabulary_size=3, dim=2, name="a")
  b = emb.TableConfig(vocabulary_size=5, dim=2, name="b")
  return {"x": emb.FeatureConfig(a, output_shape=[BATCH]),
          "y": emb.FeatureConfig(b, output_shape=[BATCH])}


def test_v2_tables_stacked_together_are_refused_by_name(tpu):
  """Wiring only (fakes, no TPU): a shared stack has no per-table variable."""
  tpu(Path.TPU_V2)
  layer = TPUEmbedding(_same_dim_config(), optimizer="sgd")
  layer.build({"x": tf.TensorShape([BATCH]), "y": tf.TensorShape([BATCH])})
  with pytest.raises(ValueError, match="disable_table_stacking") as error:
    layer.embedding_tables
  assert "'a'" in str(error.value) and "'b'" in str(error.value)


def test_v2_tables_kept_apart_are_returned(tpu):
  """Wiring only (fakes, no TPU): with stacking disabled every table maps."""
  tpu(Path.TPU_V2)
  config = _same_dim_config()
  layer = TPUEmbedding(config, optimizer="sgd",
                       sparse_core_embedding_config=emb.SparseCoreEmbeddingConfig(
                           disable_table_stacking=True))
  layer.build({"x": tf.TensorShape([BATCH]), "y": tf.TensorShape([BATCH])})
  assert {t.name: v.shape for t, v in layer.embedding_tables.items()} == {"a": (3, 2),
                                                                           "b": (5, 2)}


# --------------------------------------------------------------------------------------------
# Created under one strategy, called under another


def _mirrored():
  return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def _one_device():
  return tf.distribute.OneDeviceStrategy("/cpu:0")


@pytest.mark.parametrize("create,call", [(_one_device, _mirrored), (_mirrored, _one_device)],
                         ids=["one_device_then_mirrored", "mirrored_then_one_device"])
def test_cpu_layer_called_under_another_strategy_is_refused(create, call):
  """CPU path, real strategies: the refusal names both strategies."""
  created_under, called_under = create(), call()
  with created_under.scope():
    layer, _ = make_layer(Path.CPU)
  with called_under.scope():
    with pytest.raises(RuntimeError) as error:
      layer(features())
  message = str(error.value)
  assert type(created_under).__name__ in message
  assert type(called_under).__name__ in message


def test_cpu_layer_created_under_a_strategy_may_be_called_outside_any(tpu):
  """CPU path, real strategies: plain eager use after creating in a scope."""
  with _one_device().scope():
    layer, _ = make_layer(Path.CPU)
  assert layer(features())["watched"].shape == [BATCH, 4]


def test_tpu_layer_called_under_a_different_strategy_is_refused(tpu):
  """Wiring only (fakes, no TPU): a V1-path layer made in the default strategy refuses a
  OneDeviceStrategy."""
  tpu(Path.TPU_V1)
  layer, _ = make_layer(Path.TPU_V1)
  with _one_device().scope():
    with pytest.raises(RuntimeError) as error:
      layer(features())
  message = str(error.value)
  assert "Default" in message and "OneDeviceStrategy" in message


@pytest.mark.parametrize("path", [Path.TPU_V0, Path.TPU_V1, Path.TPU_V2])
def test_tpu_layer_called_outside_its_strategy_is_refused(tpu, path):
  """Wiring only (fakes, no TPU): made under a strategy that reports a TPU, called outside its
  scope."""
  log = tpu(path)
  strategy = _one_device()
  with strategy.scope():
    layer, _ = make_layer(path)
  with pytest.raises(RuntimeError) as error:
    layer(features())
  message = str(error.value)
  assert "OneDeviceStrategy" in message and "Default" in message
  assert "enqueue" not in log.methods() and "__call__" not in log.methods()


def test_a_refused_call_builds_nothing(tpu):
  """Wiring only (fakes, no TPU): a refused call must not initialise the TPU."""
  log = tpu(Path.TPU_V1)
  with _one_device().scope():
    layer, _ = make_layer(Path.TPU_V1)
  with pytest.raises(RuntimeError):
    layer(features())
  assert "build" not in log.methods()


# --------------------------------------------------------------------------------------------
# The Keras 3 layer drives the same backends


@pytest.mark.parametrize("path", [Path.TPU_V1, Path.TPU_V2])
def test_the_keras3_layer_drives_the_same_tpu_wiring(tpu, path):
  """Wiring only (fakes, no TPU): `tpu_embedding.keras.TPUEmbedding` in a Keras 3 model makes
  the same mid-level calls with the same gradients as the tf-keras layer."""
  import keras  # pylint: disable=g-import-not-at-top
  from tpu_embedding.keras import TPUEmbedding as Keras3TPUEmbedding  # pylint: disable=g-import-not-at-top

  class Keras3Model(keras.Model):
    def __init__(self, layer):
      super().__init__()
      self.embedding = layer

    def call(self, inputs):
      return self.embedding(inputs)

  log = tpu(path)
  layer = Keras3TPUEmbedding(feature_config([BATCH] if path is Path.TPU_V2 else None),
                             optimizer=keras.optimizers.SGD(0.1))
  assert layer.execution_path is path
  gradients = train_step(Keras3Model(layer), keras.optimizers.SGD(0.1), features(), False)
  lookup = ["enqueue", "dequeue"] if path is Path.TPU_V1 else ["__call__"]
  # Keras 3 first runs the model's call symbolically to build it (a lookup, never a gradient),
  # then the step: lookup, then the gradients applied with the step's own name or state.
  assert log.methods() == ["__init__", "build", *lookup, *lookup, "apply_gradients"]
  if path is Path.TPU_V1:
    enqueue, dequeue, apply = [arguments for _, _, arguments in log.calls[-3:]]
    assert enqueue["training"] is True and dequeue["name"] == apply["name"] == enqueue["name"]
  else:
    call, apply = [arguments for _, _, arguments in log.calls[-2:]]
    assert apply["preserved_outputs"] is call["preserved"]
  _check_gradients(layer, log, gradients)


def test_the_keras3_layer_refuses_a_tpu_without_embedding_engine(tpu):
  """On V0 the model's optimizer would have to train the tables, which Keras 3 cannot."""
  import keras  # pylint: disable=g-import-not-at-top
  from tpu_embedding.keras import TPUEmbedding as Keras3TPUEmbedding  # pylint: disable=g-import-not-at-top
  tpu(Path.TPU_V0)
  with pytest.raises(ValueError, match="TPU_V0: these tables would be trained by the model's"):
    Keras3TPUEmbedding(feature_config(), optimizer=keras.optimizers.SGD(0.1))
