"""Checkpoints of models holding a TPUEmbedding layer: real files, fresh processes, TPU layout.

The user's own checkpoint code (`tf.train.Checkpoint(model=..., optimizer=...)`) is all that is
used. A training process writes the checkpoint and a NumPy dump of every variable; a second,
fresh process restores it and dumps again; values must be bit-identical. A restore that does not
fit (a table missing, or of another shape) must be refused before any embedding variable changes.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tpu_embedding
from tpu_embedding import checkpoints

E = tf.tpu.experimental.embedding
pytestmark = pytest.mark.integration  # starts processes (make test-fast leaves it out)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STEPS = 3
FEATURES = {"user": [1, 2, 3, 2], "movie": [4, 5, 4, 0]}


def feature_config(optimizers=True, movie_rows=50, with_movie=True):
  """Two tables: `user` trained with Adagrad, `movie` with Adam (their own optimizers)."""
  user = E.TableConfig(100, 4, name="user", optimizer=E.Adagrad(0.1) if optimizers else None)
  movie = E.TableConfig(movie_rows, 8, name="movie", optimizer=E.Adam(0.01) if optimizers else None)
  config = {"user": E.FeatureConfig(user)}
  if with_movie:
    config["movie"] = E.FeatureConfig(movie)
  return config


class Ranker(tf_keras.Model):
  def __init__(self, config, optimizer="sgd", **layer_kwargs):
    super().__init__()
    self.embedding = tpu_embedding.TPUEmbedding(config, optimizer=optimizer, **layer_kwargs)
    self.dense = tf_keras.layers.Dense(1)

  def call(self, features):
    activations = self.embedding(features)
    return self.dense(tf.concat([activations[k] for k in sorted(activations)], axis=1))


def batch(names=("movie", "user")):
  return {k: tf.constant(FEATURES[k], tf.int64) for k in names}


def train(model, optimizer, steps=STEPS):
  features = batch(
    [k for k in ("movie", "user") if k in model.embedding.embedding_config.feature_config]
  )
  for step in range(steps):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean((model(features) - float(step)) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))


def engine_variables(model):
  """{"<table>" or "<table>/<slot>": values} of the layer's engine."""
  out = {}
  for table, entries in model.embedding.engine.variables_by_table.items():
    for slot, variable in entries.items():
      out[table if slot == "parameters" else f"{table}/{slot}"] = variable.numpy()
  return out


def all_values(model, optimizer=None):
  values = {f"engine:{k}": v for k, v in engine_variables(model).items()}
  values.update(
    {"dense:kernel": model.dense.kernel.numpy(), "dense:bias": model.dense.bias.numpy()}
  )
  if optimizer is not None:
    values.update({f"opt:{i}": v.numpy() for i, v in enumerate(optimizer.variables())})
  return values


# ---------------------------------------------------------------------------------------------
# Entry points of the subprocesses (run as `python -c "import test_checkpoints; ..."`)


def _train_and_save(directory):
  tf.keras.utils.set_random_seed(1)
  model, optimizer = Ranker(feature_config()), tf_keras.optimizers.Adam(0.05)
  train(model, optimizer)
  path = tf.train.Checkpoint(model=model, optimizer=optimizer).save(os.path.join(directory, "ckpt"))
  np.savez(os.path.join(directory, "trained.npz"), **all_values(model, optimizer))
  with open(os.path.join(directory, "path.txt"), "w") as f:
    f.write(path)


def _restore_fresh(directory):
  tf.keras.utils.set_random_seed(2)  # other initial values than the trainer's
  model, optimizer = Ranker(feature_config()), tf_keras.optimizers.Adam(0.05)
  with open(os.path.join(directory, "path.txt")) as f:
    path = f.read()
  status = tf.train.Checkpoint(model=model, optimizer=optimizer).restore(path)
  model(batch())  # builds the layers: their variables take the checkpoint's values on creation
  optimizer.build(model.trainable_variables)
  status.assert_consumed()
  np.savez(os.path.join(directory, "restored.npz"), **all_values(model, optimizer))


def run_here(call):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT]), TF_CPP_MIN_LOG_LEVEL="3")
  result = subprocess.run(
    [sys.executable, "-c", f"import test_checkpoints as t; t.{call}"],
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(checkpoint path, {name: value}) written by a separate training process."""
  directory = str(tmp_path_factory.mktemp("trained"))
  run_here(f"_train_and_save({directory!r})")
  with open(os.path.join(directory, "path.txt")) as f:
    path = f.read()
  return path, dict(np.load(os.path.join(directory, "trained.npz")))


# ---------------------------------------------------------------------------------------------
# Round trips


def test_checkpoint_holds_the_mid_level_keys(trained):
  path, _ = trained
  keys = {name: shape for name, shape in tf.train.list_variables(path)}
  prefix = "model/embedding/_tpu_embedding/"
  for key, shape in [
    ("user", [100, 4]),
    ("user.Saccumulators", [100, 4]),
    ("movie", [50, 8]),
    ("movie.Smomenta", [50, 8]),
    ("movie.Svelocities", [50, 8]),
  ]:
    assert keys[f"{prefix}{key}/.ATTRIBUTES/VARIABLE_VALUE"] == shape
  # Nothing else of the layer is saved (no gradient-trap variable, no pipelining buffers).
  assert sorted(k for k in keys if k.startswith("model/embedding/")) == sorted(
    k for k in keys if k.startswith(prefix)
  )
  assert len([k for k in keys if k.startswith(prefix)]) == 5


def test_restore_in_a_fresh_process_is_exact(trained, tmp_path):
  path, values = trained
  with open(tmp_path / "path.txt", "w") as f:
    f.write(path)
  run_here(f"_restore_fresh({str(tmp_path)!r})")
  restored = dict(np.load(tmp_path / "restored.npz"))
  assert sorted(restored) == sorted(values)
  assert {k for k in values if k.startswith("engine:")} == {
    "engine:user",
    "engine:user/accumulators",
    "engine:movie",
    "engine:movie/momenta",
    "engine:movie/velocities",
  }
  for name, value in values.items():
    np.testing.assert_array_equal(restored[name], value, err_msg=name)
  # Training changed the tables and slots (the comparison above is not trivially true).
  assert np.any(values["engine:user/accumulators"] != 0.1)
  assert np.any(values["engine:movie/momenta"] != 0)


def test_restore_into_a_serving_only_model(trained):
  path, values = trained
  model = Ranker(feature_config(optimizers=False), optimizer=None)
  status = tf.train.Checkpoint(model=model).restore(path)
  model(batch())
  status.assert_existing_objects_matched()
  engine = model.embedding.engine.variables_by_table
  assert {t: sorted(v) for t, v in engine.items()} == {
    "user": ["parameters"],
    "movie": ["parameters"],
  }
  for table in ("user", "movie"):
    np.testing.assert_array_equal(engine[table]["parameters"].numpy(), values[f"engine:{table}"])
  np.testing.assert_array_equal(model.dense.kernel.numpy(), values["dense:kernel"])


@pytest.mark.parametrize("route", ["engine", "model"])
def test_restores_into_the_mid_level_serving_api(trained, tmp_path, route):
  """The layout is the TPU paths' one: TF's own TPUEmbeddingForServing reads it."""
  path, values = trained
  if route == "engine":  # the layer's engine saved alone, as one saves a mid-level object
    model = Ranker(feature_config())
    tf.train.Checkpoint(model=model).restore(path).expect_partial()
    model(batch())
    path = tf.train.Checkpoint(embedding=model.embedding.engine).save(str(tmp_path / "engine"))
  serving = E.TPUEmbeddingForServing(feature_config(optimizers=False), optimizer=None)
  if route == "engine":
    root = tf.train.Checkpoint(embedding=serving)
  else:  # the model's checkpoint, through the attribute path the layer uses
    root = tf.train.Checkpoint(
      model=tf.train.Checkpoint(embedding=tf.train.Checkpoint(_tpu_embedding=serving))
    )
  root.restore(path).expect_partial()
  serving.build()
  for config, variable in serving.embedding_tables.items():
    np.testing.assert_array_equal(variable.numpy(), values[f"engine:{config.name}"])


def test_mid_level_checkpoint_restores_into_the_layer(tmp_path):
  """And back: a checkpoint of TF's TPUEmbeddingForServing restores into the layer."""
  serving = E.TPUEmbeddingForServing(feature_config(optimizers=False), optimizer=None)
  serving.build()
  path = tf.train.Checkpoint(
    model=tf.train.Checkpoint(embedding=tf.train.Checkpoint(_tpu_embedding=serving))
  ).save(str(tmp_path / "mid"))
  model = Ranker(feature_config(optimizers=False), optimizer=None)
  model(batch())
  tf.train.Checkpoint(model=model).restore(path).expect_partial()
  for config, variable in serving.embedding_tables.items():
    np.testing.assert_array_equal(
      model.embedding.engine.variables_by_table[config.name]["parameters"].numpy(),
      variable.numpy(),
    )


def test_pipelined_updates_are_flushed_into_the_checkpoint(tmp_path):
  model = Ranker(feature_config(), pipeline_execution_with_tensor_core=True)
  train(model, tf_keras.optimizers.SGD(0.1), steps=2)
  held_back = engine_variables(model)["user"].copy()
  path = tf.train.Checkpoint(model=model).save(str(tmp_path / "c"))
  saved = tf.train.load_checkpoint(path).get_tensor(
    "model/embedding/_tpu_embedding/user/.ATTRIBUTES/VARIABLE_VALUE"
  )
  assert not np.array_equal(saved, held_back)  # the pending update of the last step is in it
  np.testing.assert_array_equal(saved, engine_variables(model)["user"])


# ---------------------------------------------------------------------------------------------
# Refused restores: every embedding variable keeps its value


def built_model(seed, **kwargs):
  tf.keras.utils.set_random_seed(seed)
  model = Ranker(feature_config(**kwargs))
  model(batch(["user", "movie"] if kwargs.get("with_movie", True) else ["user"]))
  return model


@pytest.mark.parametrize("built", [True, False])
def test_table_of_another_shape_is_refused_and_nothing_changes(trained, built):
  path, values = trained
  tf.keras.utils.set_random_seed(3)
  model = Ranker(feature_config(movie_rows=60))
  if built:
    model(batch())
    before = all_values(model)
  with pytest.raises(ValueError) as error:
    tf.train.Checkpoint(model=model).restore(path)
  message = str(error.value)
  assert "table 'movie' has shape [60, 8] in this layer but [50, 8] in the checkpoint" in message
  assert "slot 'movie/velocities' of table 'movie'" in message
  assert "'user'" not in message  # the table that fits is not reported
  if not built:
    model(batch())  # the layer (and the dense layer) are created after the refused restore
    before = None
  after = all_values(model)
  if before is not None:
    for name, value in before.items():
      np.testing.assert_array_equal(after[name], value, err_msg=name)
  # No variable took a value from the refused checkpoint, now or when built later: not the
  # table that fits ("user"), not its slot, not the dense layer's kernel.
  for name in ("engine:user", "engine:user/accumulators", "dense:kernel"):
    assert not np.array_equal(after[name], values[name]), name


def test_missing_table_is_refused_and_nothing_changes(tmp_path):
  small = built_model(4, with_movie=False)  # writes only the `user` table (and its slot)
  path = tf.train.Checkpoint(model=small).save(str(tmp_path / "small"))
  model = built_model(5)
  before = all_values(model)
  with pytest.raises(ValueError) as error:
    tf.train.Checkpoint(model=model).restore(path)
  assert "table 'movie' (shape [50, 8] in this layer) is missing from the checkpoint" in str(
    error.value
  )
  after = all_values(model)
  for name, value in before.items():
    np.testing.assert_array_equal(after[name], value, err_msg=name)


def test_missing_slot_is_refused(tmp_path):
  sgd = Ranker(feature_config(optimizers=False), optimizer="sgd")  # no slots in its checkpoint
  sgd(batch())
  path = tf.train.Checkpoint(model=sgd).save(str(tmp_path / "sgd"))
  model = built_model(6)
  with pytest.raises(
    ValueError,
    match="slot 'user/accumulators' of table 'user' "
    r"\(shape \[100, 4\] in this layer\) is missing",
  ):
    tf.train.Checkpoint(model=model).restore(path)


def test_keras_managed_tables_expect_no_slots(trained):
  path, values = trained
  model = Ranker(feature_config(), table_updates="keras")
  tf.train.Checkpoint(model=model).restore(path).expect_partial()
  model(batch())
  np.testing.assert_array_equal(engine_variables(model)["movie"], values["engine:movie"])


def test_expected_shapes_are_what_the_engine_creates():
  model = built_model(7)
  engine = model.embedding.engine
  tracked = {
    name: list(v.shape) for name, v in tf.train.TrackableView(engine).children(engine).items()
  }
  expected = checkpoints.expected_shapes(model.embedding.embedding_config, with_slots=True)
  assert tracked == {name: shape for name, (_, shape) in expected.items()}


# ---------------------------------------------------------------------------------------------
# Checkpoints written by tf-recommenders 0.7.7 itself (tests/jobs/tfrs_checkpoint_writer.py)

sys.path.insert(0, os.path.join(HERE, "jobs"))  # also for this module imported by a child
import tfrs_checkpoint_writer as tfrs_writer  # noqa: E402

# The engine's name of each slot, and tf-recommenders' (its Keras optimizer's).
TFRS_SLOTS = {
  "sgd": {},
  "adagrad": {"accumulators": "accumulator"},
  "adam": {"momenta": "m", "velocities": "v"},
  "ftrl": {"accumulators": "accumulator", "linears": "linear"},
}


@pytest.fixture(scope="module")
def tfrs_checkpoints(tmp_path_factory):
  """{(layer, optimizer): checkpoint path}, written by tf-recommenders in a subprocess."""
  directory = tmp_path_factory.mktemp("tfrs")
  result = subprocess.run(
    [sys.executable, os.path.join(HERE, "jobs", "tfrs_checkpoint_writer.py"), str(directory)],
    env=dict(os.environ, TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="3"),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  paths = {case: str(directory / "-".join(case) / "ckpt") for case in tfrs_writer.CASES}
  for layer_name, optimizer_name in tfrs_writer.CASES:
    paths[(layer_name, optimizer_name, "untrained")] = str(
      directory / f"{layer_name}-{optimizer_name}-untrained" / "ckpt-1"
    )
  return paths


def our_model(layer_name, optimizer_name, **kwargs):
  """tf-recommenders' model from the writer, with this package's layer (the user's one change)."""
  optimizer = tfrs_writer.keras_optimizer(optimizer_name, tf_keras.optimizers.legacy)
  config = tfrs_writer.feature_config()
  if layer_name == "TPUEmbedding":
    layer = tpu_embedding.TPUEmbedding(config, optimizer, **kwargs)
  else:
    layer = tpu_embedding.PartialTPUEmbedding(
      config, optimizer, size_threshold=tfrs_writer.SIZE_THRESHOLD, **kwargs
    )
  model = tfrs_writer.build_model(layer, optimizer, tf_keras)
  model(tfrs_writer.inputs())
  return model, optimizer


def tfrs_key(layer_name, table, slot=None):
  """Where tf-recommenders stored a table (Partial: `small` is replicated, `large` sharded)."""
  if layer_name == "TPUEmbedding":
    key = f"model/embedding/_tpu_embedding/{table}"
  elif table == "small":
    key = "model/embedding/_keras_embedding_layers/a/embeddings"
  else:
    key = f"model/embedding/_tpu_embedding/_tpu_embedding/{table}"
  if slot is not None:
    key += f"/.OPTIMIZER_SLOT/optimizer/{slot}"
  return key + "/.ATTRIBUTES/VARIABLE_VALUE"


@pytest.mark.parametrize("layer_name,optimizer_name", tfrs_writer.CASES)
def test_tfrs_checkpoint_restores_every_table_and_slot(
  tfrs_checkpoints, layer_name, optimizer_name
):
  path = tfrs_checkpoints[(layer_name, optimizer_name)]
  model, optimizer = our_model(layer_name, optimizer_name)
  tf.train.Checkpoint(model=model, optimizer=optimizer).restore(path)
  variables = model.embedding.variables_by_table
  restored = 0
  for table in ("small", "large"):
    expected = {"parameters": tf.train.load_variable(path, tfrs_key(layer_name, table))}
    for ours, keras in TFRS_SLOTS[optimizer_name].items():
      expected[ours] = tf.train.load_variable(path, tfrs_key(layer_name, table, keras))
    assert sorted(variables[table]) == sorted(expected)
    for name, value in expected.items():
      np.testing.assert_array_equal(variables[table][name].numpy(), value, err_msg=name)
      restored += 1
  assert restored == 2 * (1 + len(TFRS_SLOTS[optimizer_name]))
  np.testing.assert_array_equal(
    model.dense.kernel.numpy(),
    tf.train.load_variable(path, "model/dense/kernel/.ATTRIBUTES/VARIABLE_VALUE"),
  )
  # The engine trains the tables: the Keras optimizer made no slot of its own for them.
  assert not [v for v in optimizer.variables() if v.shape.rank == 2 and v.shape[0] in (8, 30)]


@pytest.mark.parametrize("layer_name,optimizer_name", tfrs_writer.CASES)
def test_tfrs_checkpoint_written_before_the_first_step_matches_every_object(
  tfrs_checkpoints, layer_name, optimizer_name
):
  """tf-recommenders' Keras optimizer creates its hyperparameter variables (learning_rate,
  decay, momentum...) at the first step; the layer must not create them earlier, so a model
  built but not trained has exactly the objects of tf-recommenders' checkpoint."""
  path = tfrs_checkpoints[(layer_name, optimizer_name, "untrained")]
  model, optimizer = our_model(layer_name, optimizer_name)
  assert optimizer.variables() == []
  assert len(model.embedding.weights) == len(model.embedding.variables)
  assert not [w for w in model.embedding.weights if w.shape.rank == 0]  # no hyperparameter
  status = tf.train.Checkpoint(model=model, optimizer=optimizer).restore(path)
  status.assert_existing_objects_matched()
  for table, variables in model.embedding.variables_by_table.items():
    np.testing.assert_array_equal(
      variables["parameters"].numpy(),
      tf.train.load_variable(path, tfrs_key(layer_name, table)),
    )


@pytest.mark.parametrize("layer_name", ["TPUEmbedding", "PartialTPUEmbedding"])
def test_tfrs_checkpoint_restores_into_keras_managed_tables(tfrs_checkpoints, layer_name):
  """table_updates="keras" is tf-recommenders' CPU behaviour: its Keras optimizer's slots."""
  path = tfrs_checkpoints[(layer_name, "adagrad")]
  model, optimizer = our_model(layer_name, "adagrad", table_updates="keras")
  tf.train.Checkpoint(model=model, optimizer=optimizer).restore(path)
  tables = model.embedding.variables_by_table
  assert sorted(tables) == ["large", "small"]
  for table, variables in tables.items():
    np.testing.assert_array_equal(
      variables["parameters"].numpy(), tf.train.load_variable(path, tfrs_key(layer_name, table))
    )
    np.testing.assert_array_equal(
      optimizer.get_slot(variables["parameters"], "accumulator").numpy(),
      tf.train.load_variable(path, tfrs_key(layer_name, table, "accumulator")),
    )


@pytest.mark.parametrize("layer_name", ["TPUEmbedding", "PartialTPUEmbedding"])
def test_tfrs_slots_of_another_optimizer_are_refused_by_name(tfrs_checkpoints, layer_name):
  path = tfrs_checkpoints[(layer_name, "adagrad")]
  model, optimizer = our_model(layer_name, "adam")
  before = {t: v["parameters"].numpy() for t, v in model.embedding.variables_by_table.items()}
  with pytest.raises(ValueError) as error:
    tf.train.Checkpoint(model=model, optimizer=optimizer).restore(path)
  message = str(error.value)
  assert f"into this {layer_name} layer" in message
  for table, shape in (("small", [8, 4]), ("large", [30, 2])):
    for slot in ("momenta", "velocities"):
      assert (
        f"slot '{table}/{slot}' of table '{table}' (shape {shape} in this layer) is "
        "missing from the checkpoint"
      ) in message
  after = model.embedding.variables_by_table
  for table, value in before.items():
    np.testing.assert_array_equal(after[table]["parameters"].numpy(), value, err_msg=table)


@pytest.mark.parametrize("table_updates", ["engine", "keras"])
@pytest.mark.parametrize("layer_name", ["TPUEmbedding", "PartialTPUEmbedding"])
def test_our_checkpoint_loads_back_into_tfrs(tmp_path, layer_name, table_updates):
  """Tables always; slots only where the Keras optimizer owned them (table_updates="keras")."""
  model, optimizer = our_model(layer_name, "adagrad", table_updates=table_updates)
  model.fit(
    tf.data.Dataset.from_tensors((tfrs_writer.inputs(), tf.constant(tfrs_writer.LABELS))).repeat(2),
    verbose=0,
  )
  path = tf.train.Checkpoint(model=model, optimizer=optimizer).write(str(tmp_path / "ours"))
  out = str(tmp_path / "tfrs.npz")
  result = subprocess.run(
    [
      sys.executable,
      os.path.join(HERE, "jobs", "tfrs_checkpoint_writer.py"),
      "--read",
      path,
      out,
      layer_name,
    ],
    env=dict(os.environ, TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="3"),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  loaded = np.load(out)
  tables = model.embedding.variables_by_table
  assert sorted(tables) == ["large", "small"]
  for table, variables in tables.items():
    np.testing.assert_array_equal(loaded[table], variables["parameters"].numpy())
    if table_updates == "keras":
      np.testing.assert_array_equal(
        loaded[table + "/accumulator"],
        optimizer.get_slot(variables["parameters"], "accumulator").numpy(),
      )
    else:  # the engine's slots are not where tf-recommenders looks: its own start afresh
      fresh = loaded[table + "/accumulator"]
      assert np.isnan(fresh).all() or (fresh == np.float32(0.1)).all(), fresh
      assert (variables["accumulators"].numpy() != np.float32(0.1)).any()
