"""Serving: `call(..., serving_config=...)`, `export_for_serving`, and its documentation page.

Exports are loaded back in fresh processes that import only TensorFlow, and must give exactly the
predictions of the model in memory.
"""

import glob
import hashlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from tensorflow_only import TensorFlowOnly

import tpu_embedding
from tpu_embedding import serving

pytestmark = pytest.mark.integration  # starts processes (make test-fast leaves it out)

E = tf.tpu.experimental.embedding
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BIN = os.path.dirname(sys.executable)
INPUTS = {"user_id": [1, 2, 3, 99, 0], "movie_id": [4, 5, 4, 0, 49], "genre_id": [1, 1, 2, 0, 19]}


def feature_config():
  """Three tables with their own optimizers: Adagrad, Adam, and the layer's SGD."""
  user = E.TableConfig(100, 4, name="user", optimizer=E.Adagrad(0.1))
  movie = E.TableConfig(50, 8, name="movie", optimizer=E.Adam(0.01))
  genre = E.TableConfig(20, 3, name="genre", combiner="sum")
  return {
    "user": E.FeatureConfig(user),
    "movie": E.FeatureConfig(movie),
    "genre": E.FeatureConfig(genre),
  }


class Ranker(tf_keras.Model):
  def __init__(self, config, optimizer="sgd", layer=tpu_embedding.TPUEmbedding):
    super().__init__()
    self.config = config
    self.embedding = layer(config, optimizer=optimizer)
    self.hidden = tf_keras.layers.Dense(8, activation="relu")
    self.out = tf_keras.layers.Dense(1)

  def call(self, features):
    activations = self.embedding(features)
    return self.out(self.hidden(tf.concat([activations[k] for k in sorted(activations)], 1)))


def trained_model(seed=0):
  tf.keras.utils.set_random_seed(seed)
  model = Ranker(feature_config())
  optimizer = tf_keras.optimizers.Adam(0.05)
  features = {k[:-3]: tf.constant(v, tf.int64) for k, v in INPUTS.items()}
  for step in range(3):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean((model(features) - step) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
  return model


def signatures(model):
  """The two ways a request arrives: dense ids, or serialized tf.train.Example protos."""
  ids = [tf.TensorSpec([None], tf.int64, name=name) for name in INPUTS]

  @tf.function(input_signature=ids, autograph=False)
  def dense_ids(user_id, movie_id, genre_id):
    return {"score": model({"user": user_id, "movie": movie_id, "genre": genre_id})}

  @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="examples")], autograph=False)
  def examples(serialized):
    parsed = tf.io.parse_example(
      serialized, {k: tf.io.FixedLenFeature([], tf.int64) for k in ("user", "movie", "genre")}
    )
    return {"score": model(parsed)}

  @tf.function(input_signature=ids[:2], autograph=False)
  def user_movie(user_id, movie_id):
    """Reads two of the three tables, through a serving config covering only them."""
    config = {"user": model.config["user"], "movie": model.config["movie"]}
    activations = model.embedding({"user": user_id, "movie": movie_id}, serving_config=config)
    return {"dot": tf.reduce_sum(activations["user"] * activations["movie"][:, :4], axis=1)}

  return {"serving_default": dense_ids, "examples": examples, "user_movie": user_movie}


def serialized_examples():
  out = []
  for i in range(len(INPUTS["user_id"])):
    feature = {
      k[:-3]: tf.train.Feature(int64_list=tf.train.Int64List(value=[v[i]]))
      for k, v in INPUTS.items()
    }
    out.append(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
  return out


def files_digest(directory):
  digest = hashlib.sha256()
  for path in sorted(glob.glob(os.path.join(directory, "**"), recursive=True)):
    if os.path.isfile(path):
      digest.update(os.path.relpath(path, directory).encode())
      with open(path, "rb") as f:
        digest.update(f.read())
  return digest.hexdigest()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """(model, export dir, in-memory outputs of each signature on INPUTS)."""
  model = trained_model()
  fns = signatures(model)
  directory = str(tmp_path_factory.mktemp("export") / "ranker")
  assert serving.export_for_serving(model, directory, fns) == directory
  ids = {k: tf.constant(v, tf.int64) for k, v in INPUTS.items()}
  expected = {
    "serving_default": fns["serving_default"](**ids)["score"].numpy(),
    "examples": fns["examples"](tf.constant(serialized_examples()))["score"].numpy(),
    "user_movie": fns["user_movie"](ids["user_id"], ids["movie_id"])["dot"].numpy(),
  }
  return model, directory, expected


# ---------------------------------------------------------------------------------------------
# call(features, serving_config=...)


def test_serving_config_subset_gives_the_layers_activations():
  model = trained_model()
  features = {k[:-3]: tf.constant(v, tf.int64) for k, v in INPUTS.items()}
  full = model.embedding(features)
  config = model.config
  by_object = {"movie": E.FeatureConfig(config["movie"].table)}  # same TableConfig object
  renamed = E.TableConfig(100, 4, name="user")  # another object, matched by its name
  by_name = {"u": E.FeatureConfig(renamed)}
  out = model.embedding({"movie": features["movie"]}, serving_config=by_object)
  np.testing.assert_array_equal(out["movie"].numpy(), full["movie"].numpy())
  out = model.embedding({"u": features["user"]}, serving_config=by_name)
  np.testing.assert_array_equal(out["u"].numpy(), full["user"].numpy())
  table = model.embedding.embedding_tables[config["genre"].table].numpy()
  out = model.embedding({"genre": features["genre"]}, serving_config={"genre": config["genre"]})
  np.testing.assert_array_equal(out["genre"].numpy(), table[INPUTS["genre_id"]])


def test_serving_config_with_an_unknown_table_is_refused():
  model = trained_model()
  stranger = E.TableConfig(10, 4, name="stranger")
  with pytest.raises(
    ValueError,
    match="uses table 'stranger', which this layer does not have; "
    r"its tables are \['genre', 'movie', 'user'\]",
  ):
    model.embedding(
      {"x": tf.constant([1], tf.int64)}, serving_config={"x": E.FeatureConfig(stranger)}
    )


# ---------------------------------------------------------------------------------------------
# The export


LOAD_WITH_TENSORFLOW_ONLY = textwrap.dedent("""
    import sys, numpy as np, tensorflow as tf
    loaded = tf.saved_model.load(directory)
    ids = {k: tf.constant(v, tf.int64) for k, v in inputs.items()}
    results = {
        "serving_default": loaded.signatures["serving_default"](**ids)["score"].numpy(),
        "examples": loaded.signatures["examples"](examples=tf.constant(examples))["score"].numpy(),
        "user_movie": loaded.signatures["user_movie"](
            user_id=ids["user_id"], movie_id=ids["movie_id"])["dot"].numpy(),
    }
    tables = sorted(loaded.embedding_tables)
    try:  # movie's table has 50 rows
      loaded.signatures["serving_default"](**dict(ids, movie_id=tf.constant([3, 50], tf.int64)))
      refused = ""
    except tf.errors.InvalidArgumentError as e:
      refused = e.message
    assert not [m for m in sys.modules if m.startswith(("tpu_embedding", "tf_keras"))], sys.modules
    np.savez(out, tables=np.array(tables), refused=np.array(refused), **results)
""")


@pytest.fixture(scope="module")
def tensorflow_only():
  """This module's serving process with neither this package nor tf-keras importable
  (tests/support/tensorflow_only.py)."""
  child = TensorFlowOnly(refused=("tpu_embedding", "tf_keras"))
  yield child
  child.close()


@pytest.fixture(scope="module")
def without_package():
  """This module's serving process without this package (tf-keras may load, as it must for a
  SavedModel holding a Keras optimizer's slots)."""
  child = TensorFlowOnly(refused=("tpu_embedding",))
  yield child
  child.close()


def test_export_serves_exactly_in_a_process_with_only_tensorflow(
  exported, tmp_path, tensorflow_only
):
  model, directory, expected = exported
  out = str(tmp_path / "served.npz")
  given = dict(directory=directory, inputs=INPUTS, examples=serialized_examples(), out=out)
  tensorflow_only.run(
    "".join(f"{name} = {value!r}\n" for name, value in given.items()) + LOAD_WITH_TENSORFLOW_ONLY
  )
  served = np.load(out)
  for name, value in expected.items():
    np.testing.assert_array_equal(served[name], value, err_msg=name)
  assert list(served["tables"]) == ["genre", "movie", "user"]
  # An id outside its table is refused by the CPU gather (there is no check of our own in an
  # export's request), which names the id, the table's size, and the feature and table in the
  # name of the op.
  refused = str(served["refused"])
  assert re.search(
    r"(?s)indices\[1\] = 50 is not in \[0, 50\).*feature_movie\.table_movie/", refused
  )
  # ... and those are the model's own predictions.
  features = {k[:-3]: tf.constant(v, tf.int64) for k, v in INPUTS.items()}
  np.testing.assert_allclose(expected["serving_default"], model(features).numpy(), rtol=1e-6)
  np.testing.assert_array_equal(expected["examples"], expected["serving_default"])


def test_exported_graph_holds_only_cpu_ops(exported):
  from tensorflow.core.protobuf import saved_model_pb2
  from tensorflow.python.framework import kernels

  _, directory, _ = exported
  proto = saved_model_pb2.SavedModel()
  with open(os.path.join(directory, "saved_model.pb"), "rb") as f:
    proto.ParseFromString(f.read())
  graph = proto.meta_graphs[0].graph_def
  ops = {n.op for n in graph.node}
  ops |= {n.op for fn in graph.library.function for n in fn.node_def}
  assert "ResourceGather" in ops or "GatherV2" in ops  # the lookups are there
  no_cpu = [
    op
    for op in ops
    if not any(
      k.device_type in ("CPU", "DEFAULT") for k in kernels.get_registered_kernels_for_op(op).kernel
    )
  ]
  assert no_cpu == []
  assert not [op for op in ops if "TPU" in op.upper()]


def test_a_whole_model_saved_after_compiled_training_loads_with_only_tensorflow(
  tmp_path, without_package
):
  """`tf.saved_model.save` also saves the training graph's gradients, where the engine's compiled
  kernels run; they are traced for the SavedModel with TF's own ops, so it loads anywhere."""
  tf.keras.utils.set_random_seed(0)
  model = Ranker(feature_config())
  optimizer = tf_keras.optimizers.SGD(0.1)
  features = {k[:-3]: tf.constant(v, tf.int64) for k, v in INPUTS.items()}

  @tf.function
  def train_step():
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(model(features) ** 2)
    optimizer.apply_gradients(
      zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    )

  train_step()
  kernel_ops = [
    op.type
    for op in train_step.get_concrete_function().graph.get_operations()
    if op.type == "TpuEmbeddingApplyRows"
  ]
  assert len(kernel_ops) == 3  # one per table: the kernels did the training
  directory = str(tmp_path / "whole")
  tf.saved_model.save(model, directory)
  without_package.run(
    textwrap.dedent(f"""
      import sys
      import numpy as np, tensorflow as tf
      loaded = tf.saved_model.load({directory!r})
      features = {{k[:-3]: tf.constant(v, tf.int64) for k, v in {INPUTS!r}.items()}}
      np.save({str(tmp_path / "scores.npy")!r}, loaded(features).numpy())
      assert not [m for m in sys.modules if m.startswith("tpu_embedding")]
      """)
  )
  np.testing.assert_allclose(np.load(tmp_path / "scores.npy"), model(features).numpy(), rtol=1e-6)


KERAS_ADAGRAD_LAYERS = {
  "TPUEmbedding": tpu_embedding.TPUEmbedding,
  # genre (20 rows) replicated, movie and user sharded
  "PartialTPUEmbedding": lambda config, optimizer: tpu_embedding.PartialTPUEmbedding(
    config, optimizer, size_threshold=20
  ),
}


@pytest.mark.parametrize(
  "layer,steps,traced",
  [
    ("TPUEmbedding", 2, "while saving"),
    ("TPUEmbedding", 0, "while saving"),
    ("PartialTPUEmbedding", 2, "while saving"),
    ("TPUEmbedding", 0, "before saving"),
    ("PartialTPUEmbedding", 2, "before saving"),
  ],
)
def test_plain_saved_model_save_with_a_keras_optimizer_serves_with_only_tensorflow(
  tmp_path, layer, steps, traced, without_package
):
  """tfrs's guide saves with `tf.saved_model.save(model, path, signatures=...)`. The layer's Keras
  optimizer (not the model's here) is a variable the model does not reach: a serving trace made
  while saving has no trap, and the gradient TF saves for a trace made before carries the
  learning rate as a constant."""
  tf.keras.utils.set_random_seed(0)
  model = Ranker(
    feature_config(), tf_keras.optimizers.legacy.Adagrad(0.5), KERAS_ADAGRAD_LAYERS[layer]
  )
  features = {k[:-3]: tf.constant(v, tf.int64) for k, v in INPUTS.items()}
  model.compile(tf_keras.optimizers.legacy.Adagrad(0.5), "mse")
  if steps:
    before = model(features).numpy()
    model.fit(tf.data.Dataset.from_tensors((features, tf.ones([5, 1]))).repeat(steps), verbose=0)
    assert np.abs(model(features).numpy() - before).max() > 1e-3  # it did train
  else:
    model(features)
  directory = str(tmp_path / "plain")
  serving = signatures(model)["serving_default"]
  if traced == "before saving":
    serving = serving.get_concrete_function()
  tf.saved_model.save(model, directory, signatures={"serving_default": serving})
  without_package.run(
    textwrap.dedent(f"""
      import numpy as np, tensorflow as tf
      loaded = tf.saved_model.load({directory!r})
      ids = {{k: tf.constant(v, tf.int64) for k, v in {INPUTS!r}.items()}}
      np.save({str(tmp_path / "scores.npy")!r},
              loaded.signatures["serving_default"](**ids)["score"].numpy())
      """)
  )
  # Equal to float32 rounding: the serving process (TensorFlow alone) can round the last bit of a
  # score differently from this one (1 ulp, 3e-8, seen on this machine in the untrained case, at
  # the commit before this round too).
  np.testing.assert_allclose(
    np.load(tmp_path / "scores.npy"), model(features).numpy(), rtol=1e-6, atol=0
  )


def saved_keys(directory):
  return {k for k, _ in tf.train.list_variables(os.path.join(directory, "variables", "variables"))}


def test_slots_are_left_out_unless_asked_for(exported, tmp_path):
  model, directory, _ = exported
  keys = saved_keys(directory)
  assert {k.split("/")[0] for k in keys} == {
    "embedding_tables",
    "model_variables",
    "_CHECKPOINTABLE_OBJECT_GRAPH",
  }
  with_slots = serving.export_for_serving(
    model, str(tmp_path / "slots"), signatures(model), include_optimizer_slots=True
  )
  slot_keys = {k for k in saved_keys(with_slots) if k.startswith("optimizer_slots/")}
  assert slot_keys == {
    f"optimizer_slots/{s}/.ATTRIBUTES/VARIABLE_VALUE"
    for s in ("user/accumulators", "movie/momenta", "movie/velocities")
  }
  size = lambda d: sum(os.path.getsize(p) for p in glob.glob(f"{d}/variables/*"))  # noqa: E731
  assert size(directory) + 4 * (100 * 4 + 2 * 50 * 8) <= size(with_slots)
  loaded = tf.saved_model.load(with_slots)
  engine = model.embedding.variables_by_table
  np.testing.assert_array_equal(
    loaded.optimizer_slots["movie"]["velocities"].numpy(), engine["movie"]["velocities"].numpy()
  )


def test_only_the_tables_the_signatures_read_are_exported(exported, tmp_path):
  model, _, _ = exported
  fns = signatures(model)
  subset = {"user_movie": fns["user_movie"]}
  path = serving.export_for_serving(model, str(tmp_path / "pruned"), subset)
  assert sorted(tf.saved_model.load(path).embedding_tables) == ["movie", "user"]
  path = serving.export_for_serving(model, str(tmp_path / "all"), subset, tables="all")
  assert sorted(tf.saved_model.load(path).embedding_tables) == ["genre", "movie", "user"]
  config = model.config
  path = serving.export_for_serving(
    model, str(tmp_path / "listed"), subset, tables=[config["user"].table, "movie"]
  )
  assert sorted(tf.saved_model.load(path).embedding_tables) == ["movie", "user"]
  with pytest.raises(
    ValueError,
    match=r"read the table\(s\) \['movie'\], which tables= does "
    r"not list \(\['user'\]\)",
  ):
    serving.export_for_serving(model, str(tmp_path / "guard"), subset, tables=["user"])
  with pytest.raises(ValueError, match="'nope', which no TPUEmbedding layer"):
    serving.export_for_serving(model, str(tmp_path / "guard"), subset, tables=["nope"])
  assert not os.path.exists(tmp_path / "guard")


def test_existing_export_is_refused_unless_overwrite(exported, tmp_path):
  model, _, _ = exported
  fns = signatures(model)
  target = str(tmp_path / "model")
  serving.export_for_serving(model, target, {"user_movie": fns["user_movie"]})
  before = files_digest(target)
  with pytest.raises(FileExistsError, match=re.escape(target)):
    serving.export_for_serving(model, target, fns)
  assert files_digest(target) == before
  serving.export_for_serving(model, target, fns, overwrite=True)
  assert sorted(tf.saved_model.load(target).signatures) == sorted(fns)
  assert os.listdir(tmp_path) == ["model"]  # no staging or old copies left behind


@pytest.mark.parametrize("setup", ["user_files", "empty_dir", "file", "export_plus_notes"])
def test_overwrite_replaces_only_a_saved_model(exported, tmp_path, setup):
  """overwrite=True never deletes a directory or file that is not an earlier export."""
  model, _, _ = exported
  fns = {"user_movie": signatures(model)["user_movie"]}
  target = tmp_path / "target"
  if setup == "file":
    target.write_text("mine")
  elif setup == "export_plus_notes":
    serving.export_for_serving(model, str(target), fns)
    (target / "notes.txt").write_text("mine")
  else:
    target.mkdir()
    if setup == "user_files":
      (target / "notes.txt").write_text("mine")
  before = files_digest(str(target)) if target.is_dir() else target.read_text()
  with pytest.raises(FileExistsError, match=re.escape(str(target)) + ".*not a SavedModel"):
    serving.export_for_serving(model, str(target), fns, overwrite=True)
  assert (files_digest(str(target)) if target.is_dir() else target.read_text()) == before
  assert sorted(os.listdir(tmp_path)) == ["target"]


def test_empty_export_dir_is_refused(exported, tmp_path, monkeypatch):
  model, _, _ = exported
  monkeypatch.chdir(tmp_path)
  (tmp_path / "notes.txt").write_text("mine")
  with pytest.raises(ValueError, match="export_dir is empty"):
    serving.export_for_serving(model, "", signatures(model)["user_movie"], overwrite=True)
  assert os.listdir(tmp_path) == ["notes.txt"]


def test_export_arguments_of_the_wrong_kind_are_refused_by_name(exported, tmp_path):
  model, _, _ = exported
  fns = signatures(model)["user_movie"]
  with pytest.raises(TypeError, match="export_dir=None: expected a path"):
    serving.export_for_serving(model, None, fns)
  with pytest.raises(ValueError, match="tables=3: expected None, 'all', or a list"):
    serving.export_for_serving(model, str(tmp_path / "x"), fns, tables=3)
  assert os.listdir(tmp_path) == []


def test_a_serving_config_table_of_another_size_is_refused(exported):
  model, _, _ = exported
  other = {"user": E.FeatureConfig(E.TableConfig(100, 5, name="user"))}
  with pytest.raises(
    ValueError,
    match=r"serving_config feature 'user' uses table 'user' with "
    r"\(vocabulary_size, dim\) = \(100, 5\), but this "
    r"layer's table has \(100, 4\)",
  ):
    model.embedding({"user": tf.constant([1])}, serving_config=other)


def test_an_exported_signature_refuses_a_hostile_sparse_request_without_aborting(
  exported, tmp_path, tensorflow_only
):
  """One request must not kill the server: a huge dense_shape is an error, in TF alone."""
  model, _, _ = exported
  spec = [
    tf.TensorSpec([None, 2], tf.int64, name="indices"),
    tf.TensorSpec([None], tf.int64, name="values"),
    tf.TensorSpec([2], tf.int64, name="dense_shape"),
  ]

  @tf.function(input_signature=spec, autograph=False)
  def sparse_users(indices, values, dense_shape):
    ids = tf.SparseTensor(indices, values, dense_shape)
    config = {"user": model.config["user"]}
    return {"user": model.embedding({"user": ids}, serving_config=config)["user"]}

  directory = serving.export_for_serving(model, str(tmp_path / "sparse"), sparse_users)
  printed = tensorflow_only.run(
    textwrap.dedent(f"""
      import tensorflow as tf
      serve = tf.saved_model.load({directory!r}).signatures["serving_default"]
      ok = serve(indices=tf.constant([[0, 0], [1, 1]], tf.int64),
                 values=tf.constant([1, 2], tf.int64), dense_shape=tf.constant([2, 2], tf.int64))
      print(ok["user"].shape)
      try:
        serve(indices=tf.constant([[0, 0]], tf.int64), values=tf.constant([1], tf.int64),
              dense_shape=tf.constant([2**61, 3], tf.int64))
      except tf.errors.InvalidArgumentError as e:
        print("refused:", e.message.replace("\\n", " "))
      """)
  )
  lines = printed.splitlines()
  assert lines[0] == "(2, 4)"
  assert lines[1].startswith("refused:") and "Feature" in lines[1] and "2147483647" in lines[1]


def test_a_signature_needs_an_input_signature(exported, tmp_path):
  model, _, _ = exported
  with pytest.raises(
    ValueError, match="'serving_default' must be a tf.function with an input_signature"
  ):
    serving.export_for_serving(model, str(tmp_path / "x"), tf.function(lambda x: model(x)))


# ---------------------------------------------------------------------------------------------
# A killed export never leaves a half model at the target


def _export_and_hang(directory, marker):
  """Subprocess: export, but stop for good once the files are written, before moving them."""
  model = trained_model(seed=1)
  write = tf.saved_model.save

  def write_then_hang(*args, **kwargs):
    write(*args, **kwargs)
    with open(marker, "w") as f:
      f.write(args[1])
    time.sleep(600)

  tf.saved_model.save = write_then_hang  # this subprocess only
  serving.export_for_serving(model, directory, signatures(model), overwrite=True)


@pytest.mark.parametrize("previous", [False, True])
def test_killed_export_leaves_no_half_model(exported, tmp_path, previous):
  model, _, expected = exported
  target = str(tmp_path / "ranker")
  if previous:
    serving.export_for_serving(model, target, signatures(model))
    before = files_digest(target)
  marker = str(tmp_path / "written")
  path = os.pathsep.join([HERE, os.path.join(HERE, "support"), ROOT])
  env = dict(os.environ, PYTHONPATH=path, TF_CPP_MIN_LOG_LEVEL="3")
  process = subprocess.Popen(
    [sys.executable, "-c", f"import test_serving as t; t._export_and_hang({target!r}, {marker!r})"],
    env=env,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
  )
  deadline = time.time() + 120
  while not os.path.exists(marker) and process.poll() is None and time.time() < deadline:
    time.sleep(0.1)
  assert os.path.exists(marker), process.stderr.read().decode()[-3000:] if process.poll() else ""
  process.send_signal(signal.SIGKILL)
  process.wait()
  with open(marker) as f:
    staging = f.read()
  assert os.path.isfile(os.path.join(staging, "saved_model.pb"))  # killed with the data written
  assert os.path.dirname(staging) == str(tmp_path) and staging != target
  if previous:
    assert files_digest(target) == before
    loaded = tf.saved_model.load(target)
    ids = {k: tf.constant(v, tf.int64) for k, v in INPUTS.items()}
    np.testing.assert_array_equal(
      loaded.signatures["serving_default"](**ids)["score"].numpy(), expected["serving_default"]
    )
  else:
    assert not os.path.exists(target)


# ---------------------------------------------------------------------------------------------
# README


def readme_section():
  with open(os.path.join(ROOT, "docs", "checkpoints-and-serving.md")) as f:
    text = f.read()
  match = re.search(
    r"<!-- section:checkpoints-serving -->(.*)<!-- /section:checkpoints-serving -->", text, re.S
  )
  assert match, "docs/checkpoints-and-serving.md: section checkpoints-serving is missing"
  return match.group(1)


def test_readme_snippets_run(tmp_path):
  """Every block of docs/checkpoints-and-serving.md's first section, in order, in a temp dir.

  Python blocks start with `# <file>.py`: each is written under that name and run in its own
  process (`ranker.py` is the module the others import); `text` blocks show checkpoint keys or
  printed output, checked against what the scripts wrote; the bash block runs saved_model_cli.
  """
  blocks = re.findall(r"```(\w*)\n(.*?)```", readme_section(), re.S)
  assert all(lang in ("python", "text", "bash") for lang, _ in blocks), blocks
  env = dict(
    os.environ,
    PYTHONPATH=ROOT,
    TF_CPP_MIN_LOG_LEVEL="3",
    PATH=BIN + os.pathsep + os.environ.get("PATH", ""),
  )
  names = []
  for lang, code in blocks:
    if lang == "python":
      names.append(re.match(r"# (\w+\.py)\n", code).group(1))
      (tmp_path / names[-1]).write_text(code)
    elif lang == "bash":
      (tmp_path / "snippet.sh").write_text(code)
      names.append("snippet.sh")
  assert names == ["ranker.py", "train.py", "restore.py", "export.py", "serve.py", "snippet.sh"]
  # Training, restoring and exporting share one process after train.py's (the restore in a
  # fresh process is tested above); serve.py runs alone, without this package or tf-keras.
  run_scripts = (
    "import runpy, sys\nfor name in sys.argv[1:]:\n"
    "  print(f'== {name}', flush=True)\n  runpy.run_path(name, run_name='__main__')"
  )
  commands = {
    "train.py": [sys.executable, "-c", run_scripts, "train.py"],
    "restore.py+export.py": [sys.executable, "-c", run_scripts, "restore.py", "export.py"],
    "serve.py": [
      sys.executable,
      "-c",
      "import runpy, sys; runpy.run_path('serve.py'); "
      "assert not [m for m in sys.modules if m.startswith(('tpu_embedding', "
      "'tf_keras'))]",
    ],
    "snippet.sh": ["bash", "-euo", "pipefail", "snippet.sh"],
  }
  output = {}
  for name, command in commands.items():
    result = subprocess.run(
      command, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"{name}:\n{result.stdout[-2000:]}{result.stderr[-3000:]}"
    output[name] = result.stdout

  keys = [
    k
    for k, _ in tf.train.list_variables(str(tmp_path / "ckpt" / "ranker-1"))
    if k.startswith("model/embedding/")
  ]
  texts = [code for lang, code in blocks if lang == "text"]
  patterns = [
    re.escape(line)
    .replace(re.escape("<layer attribute>"), "embedding")
    .replace(re.escape("<table>"), r"\w+")
    .replace(re.escape("<slot>"), r"\w+")
    for line in texts[0].splitlines()
  ]
  assert all(any(re.fullmatch(p, k) for p in patterns) for k in keys) and len(keys) == 5, keys
  assert all(any(re.fullmatch(p, k) for k in keys) for p in patterns)
  for line in texts[1].splitlines():
    if "..." not in line:
      assert line in output["restore.py+export.py"], (line, output["restore.py+export.py"])
  assert "score" in output["serve.py"]
  for shown in (
    "signature_def['serving_default']",
    "signature_def['examples']",
    "inputs['user_id'] tensor_info",
    "inputs['examples'] tensor_info",
    "outputs['score'] tensor_info",
  ):
    assert shown in output["snippet.sh"]


@pytest.mark.parametrize("optimizer", ["mid-level SGD", "Keras Adagrad", "None"])
def test_a_signature_traced_before_saving_gives_plain_table_gradients(
  tmp_path, optimizer, without_package
):
  """tfrs's notebook traces the signature, then calls tf.saved_model.save. Reloaded with only
  TensorFlow, a gradient through it must train nothing (the tables stay as saved, even with
  optimizer=None) and give the tables the gradient of a plain lookup, as tfrs's tables get."""
  tf.keras.utils.set_random_seed(0)
  config = feature_config()
  if optimizer == "None":
    config = {
      k: E.FeatureConfig(E.TableConfig(f.table.vocabulary_size, f.table.dim, name=f.table.name))
      for k, f in config.items()
    }
  layer_optimizer = {
    "mid-level SGD": "sgd",
    "Keras Adagrad": tf_keras.optimizers.legacy.Adagrad(0.5),
    "None": None,
  }[optimizer]
  model = Ranker(config, layer_optimizer)
  features = {k[:-3]: tf.constant(v, tf.int64) for k, v in INPUTS.items()}
  model(features)
  serving = signatures(model)["serving_default"].get_concrete_function()
  directory = str(tmp_path / "saved")
  tf.saved_model.save(model, directory, signatures={"serving_default": serving})

  # The reference: each feature has one id per sample, so its activation is the table's row.
  tables = {t.name: tf.Variable(v) for t, v in model.embedding.embedding_tables.items()}
  with tf.GradientTape() as tape:
    rows = [tf.gather(tables[name], features[name]) for name in sorted(tables)]
    loss = tf.reduce_sum(model.out(model.hidden(tf.concat(rows, 1))))
  expected = {
    name: tf.convert_to_tensor(g).numpy()
    for name, g in zip(tables, tape.gradient(loss, list(tables.values())))
  }
  saved_values = {name: v.numpy() for name, v in tables.items()}
  out = str(tmp_path / "out.npz")
  without_package.run(
    textwrap.dedent(f"""
      import numpy as np, tensorflow as tf
      loaded = tf.saved_model.load({directory!r})
      fn = loaded.signatures["serving_default"]
      ids = {{k: tf.constant(v, tf.int64) for k, v in {INPUTS!r}.items()}}
      tables = {{v.name.split("/")[-1][:-2]: v for v in loaded.variables
                if v.name.split("/")[-1][:-2] in {sorted(tables)!r}}}
      dense = [v for v in loaded.variables if "dense" in v.name]
      with tf.GradientTape() as tape:  # the Dense layers only
        loss = tf.reduce_sum(fn(**ids)["score"])
      assert len(dense) == 4 and all(g is not None for g in tape.gradient(loss, dense))
      with tf.GradientTape(persistent=True) as tape:
        tape.watch(list(tables.values()))
        loss = tf.reduce_sum(fn(**ids)["score"])
      grads = tape.gradient(loss, list(tables.values()))
      assert all(g is not None for g in grads), grads
      np.savez({out!r}, **{{f"value_{{k}}": v.numpy() for k, v in tables.items()}},
               **{{f"grad_{{k}}": tf.convert_to_tensor(g).numpy()
                   for k, g in zip(tables, grads)}})
      """)
  )
  found = np.load(out)
  for name in tables:
    np.testing.assert_array_equal(found[f"value_{name}"], saved_values[name])
    np.testing.assert_allclose(found[f"grad_{name}"], expected[name], rtol=1e-5, atol=1e-7)


def test_an_export_without_signatures_is_refused(exported, tmp_path):
  model, _, _ = exported
  with pytest.raises(ValueError, match="signatures is empty: an export without a signature"):
    serving.export_for_serving(model, str(tmp_path / "empty"), {})
  assert os.listdir(tmp_path) == []


def test_an_export_of_a_mirrored_model_holds_and_guards_its_tables(tmp_path):
  """Functions traced under MirroredStrategy read each table's per-device copies, which are
  matched to their table as the variable itself is."""
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  tf.keras.utils.set_random_seed(0)
  with strategy.scope():
    model = Ranker(feature_config())
  model({k[:-3]: tf.constant(v, tf.int64) for k, v in INPUTS.items()})
  fns = signatures(model)
  path = serving.export_for_serving(model, str(tmp_path / "mirrored"), fns)
  loaded = tf.saved_model.load(path)
  assert sorted(loaded.embedding_tables) == ["genre", "movie", "user"]
  for table, variable in model.embedding.embedding_tables.items():
    np.testing.assert_array_equal(loaded.embedding_tables[table.name].numpy(), variable.numpy())
  with pytest.raises(ValueError, match=r"read the table\(s\) \['movie'\], which tables= does"):
    serving.export_for_serving(
      model, str(tmp_path / "guard"), {"user_movie": fns["user_movie"]}, tables=["user"]
    )
  assert sorted(os.listdir(tmp_path)) == ["mirrored"]


def test_export_dir_given_as_bytes_is_a_path_as_in_tensorflow(exported, tmp_path):
  model, _, _ = exported
  target = str(tmp_path / "bytes")
  assert serving.export_for_serving(model, os.fsencode(target), signatures(model)) == target
  assert os.listdir(tmp_path) == ["bytes"]
  assert sorted(tf.saved_model.load(target).embedding_tables) == ["genre", "movie", "user"]


@pytest.mark.parametrize("saved_by", ["tf.saved_model.save", "export_for_serving"])
def test_reloaded_tables_are_trainable_variables_a_tape_watches(tmp_path, saved_by):
  """Reloaded, a table is a plain trainable variable, as tf-recommenders' is: a tape over a call
  gives its gradient without being asked to watch it, the call changes nothing, and an optimizer
  the user applies changes it by exactly that gradient."""
  values = np.arange(10, dtype=np.float32).reshape(5, 2)
  table = E.TableConfig(5, 2, name="videos", initializer=tf.constant_initializer(values))
  model = tf_keras.Sequential([tpu_embedding.TPUEmbedding(E.FeatureConfig(table=table), "sgd")])
  model(tf.constant([0], tf.int64))
  directory = str(tmp_path / "saved")
  if saved_by == "export_for_serving":
    serve = tf.function(model, input_signature=[tf.TensorSpec([None], tf.int64)])
    loaded = tf.saved_model.load(serving.export_for_serving(model, directory, serve))
    reloaded = loaded.embedding_tables["videos"]
    call = lambda ids: loaded.signatures["serving_default"](ids)["output_0"]
  else:
    tf.saved_model.save(model, directory)
    loaded = tf.saved_model.load(directory)
    (reloaded,) = [v for v in loaded.variables if v.name.endswith("/videos:0")]
    call = lambda ids: loaded(ids, training=True)  # the saved training function: no trap either
  ids, upstream = [1, 3, 1], np.array([[1, 2], [3, 4], [5, 6]], np.float32)
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(call(tf.constant(ids, tf.int64)) * upstream)
  gradient = tf.convert_to_tensor(tape.gradient(loss, reloaded)).numpy()
  expected = np.zeros_like(values)
  np.add.at(expected, ids, upstream)
  np.testing.assert_array_equal(gradient, expected)
  np.testing.assert_array_equal(reloaded.numpy(), values)
  tf_keras.optimizers.SGD(0.5).apply_gradients([(gradient, reloaded)])
  np.testing.assert_array_equal(reloaded.numpy(), values - 0.5 * expected)
