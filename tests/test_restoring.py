"""`tpu_embedding.restore_checkpoint`: a model restored whole or not at all."""

import os
import pathlib
import re
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tpu_embedding

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_checkpoints import our_model, tfrs_checkpoints, tfrs_key  # noqa: E402, F401  (fixture)

import tfrs_checkpoint_writer as tfrs_writer  # noqa: E402
from unchanged import assert_unchanged as assert_same  # noqa: E402
from unchanged import snapshot  # noqa: E402

pytestmark = pytest.mark.integration  # starts processes (make test-fast leaves it out)

E = tf.tpu.experimental.embedding
IDS = {"user": tf.constant([1, 2, 3]), "movie": tf.constant([0, 4, 4])}


class Ranker(tf_keras.Model):
  def __init__(self, hidden=4, seed=0, optimizer=None):
    super().__init__()
    tf_keras.utils.set_random_seed(seed)  # tf_keras layers draw from its seeds (tf.keras: Keras 3)
    self.embedding = tpu_embedding.TPUEmbedding(
      {
        "user": E.FeatureConfig(E.TableConfig(10, 2, name="user")),
        "movie": E.FeatureConfig(E.TableConfig(6, 3, name="movie")),
      },
      optimizer or E.Adagrad(0.1),
    )
    self.hidden = tf_keras.layers.Dense(hidden)
    self.out = tf_keras.layers.Dense(1)

  def call(self, features):
    found = self.embedding(features)
    return self.out(self.hidden(tf.concat([found["movie"], found["user"]], 1)))


def built(**kwargs):
  model = Ranker(**kwargs)
  model(IDS)
  return model


def values(model):
  """Every variable of the model, by its place in the model (names differ between models)."""
  found = {
    f"{t}/{s}": v.numpy()
    for t, d in model.embedding.variables_by_table.items()
    for s, v in d.items()
  }
  for layer in ("hidden", "out"):
    for part in ("kernel", "bias"):
      found[f"{layer}/{part}"] = getattr(getattr(model, layer), part).numpy()
  assert len(found) == len(model.variables) - 1  # and the gradient trap, always zero
  return found


def assert_unchanged(model, before):
  after = values(model)
  assert sorted(after) == sorted(before)
  for name, value in before.items():
    np.testing.assert_array_equal(after[name], value, err_msg=name)


def files(directory):
  return {
    name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))
  }


def test_a_fitting_checkpoint_restores_every_variable(tmp_path):
  source = built(seed=1)
  path = tf.train.Checkpoint(model=source).save(str(tmp_path / "ckpt"))
  target = built(seed=2)
  status = tpu_embedding.restore_checkpoint(target, path)
  status.assert_existing_objects_matched()
  assert_unchanged(target, values(source))
  # A directory restores its latest checkpoint.
  other = built(seed=3)
  tpu_embedding.restore_checkpoint(other, str(tmp_path))
  assert_unchanged(other, values(source))


def test_a_dense_kernel_that_does_not_fit_restores_nothing(tmp_path):
  """TF alone restores the tables and the bias before failing on the kernel."""
  path = tf.train.Checkpoint(model=built(seed=1, hidden=4)).save(str(tmp_path / "ckpt"))
  target = built(seed=2, hidden=5)
  before, on_disk = values(target), files(tmp_path)
  with pytest.raises(
    ValueError,
    match=re.escape(
      f"Cannot restore the checkpoint {path!r}:\n"
      "  - model/hidden/kernel has shape [5, 5] in the model but [5, 4] in the checkpoint\n"
      "  - model/hidden/bias has shape [5] in the model but [4] in the checkpoint\n"
      "  - model/out/kernel has shape [5, 1] in the model but [4, 1] in the checkpoint\n"
      "Nothing was restored: every variable of the model is unchanged."
    ),
  ):
    tpu_embedding.restore_checkpoint(target, path)
  assert_unchanged(target, before)
  assert files(tmp_path) == on_disk
  # What TF does without the check: a half-restored model (the reason for the helper).
  with pytest.raises(ValueError):
    tf.train.Checkpoint(model=target).restore(path)
  changed = [k for k, v in values(target).items() if not np.array_equal(v, before[k])]
  assert changed  # TF wrote some variables before it failed


def truncate(path, keep):
  with open(path, "rb") as f:
    data = f.read()
  with open(path, "wb") as f:
    f.write(data[: int(len(data) * keep)])


@pytest.mark.parametrize("damaged", ["index", "data"])
def test_a_truncated_checkpoint_file_is_named_and_restores_nothing(tmp_path, damaged):
  path = tf.train.Checkpoint(model=built(seed=1)).save(str(tmp_path / "ckpt"))
  victim = f"{path}.index" if damaged == "index" else f"{path}.data-00000-of-00001"
  truncate(victim, 0.5)
  target = built(seed=2)
  before, on_disk = values(target), files(tmp_path)
  what = "index file" if damaged == "index" else "data file"
  with pytest.raises(ValueError) as raised:
    tpu_embedding.restore_checkpoint(target, path)
  message = str(raised.value)
  assert f"Cannot read the checkpoint {path!r}: its {what}" in message
  assert "damaged or truncated" in message and os.path.basename(victim) in message
  assert message.endswith("Nothing was restored: every variable of the model is unchanged.")
  assert_unchanged(target, before)
  assert files(tmp_path) == on_disk


def test_a_missing_checkpoint_is_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="is a directory with no checkpoint"):
    tpu_embedding.restore_checkpoint(built(), str(tmp_path))
  with pytest.raises(FileNotFoundError, match=r"ckpt-9.index does not exist"):
    tpu_embedding.restore_checkpoint(built(), str(tmp_path / "ckpt-9"))


@pytest.mark.parametrize("allow_missing", [False, True])
def test_a_name_based_checkpoint_is_refused_with_one_reason(tmp_path, allow_missing):
  """A tf.compat.v1 Saver's checkpoint has no object graph: that is the whole reason (the
  model's variables were once listed as missing from it as well)."""
  with tf.Graph().as_default():
    tf.compat.v1.get_variable("hidden/kernel", initializer=tf.ones([5, 4]))
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      path = tf.compat.v1.train.Saver().save(session, str(tmp_path / "ckpt"))
  target = built(seed=2)
  before, on_disk = values(target), files(tmp_path)
  with pytest.raises(ValueError) as raised:
    tpu_embedding.restore_checkpoint(target, path, allow_missing=allow_missing)
  assert str(raised.value) == (
    f"Cannot restore the checkpoint {path!r}: it holds no object graph (it was written by a "
    "name-based tf.compat.v1 Saver); restore it with that Saver. Nothing was restored: every "
    "variable of the model is unchanged."
  )
  assert_unchanged(target, before)
  assert files(tmp_path) == on_disk


@pytest.mark.parametrize("damaged", ["index", "data"])
def test_a_truncated_tfrs_checkpoint_is_named_and_restores_nothing(
  tfrs_checkpoints,  # noqa: F811  (the fixture imported above)
  tmp_path,
  damaged,
):
  tfrs_checkpoint = pathlib.Path(tfrs_checkpoints[("TPUEmbedding", "adagrad")]).parent
  import shutil

  copy = tmp_path / "ckpt"
  shutil.copytree(tfrs_checkpoint, copy)
  path = str(copy / "ckpt")
  truncate(f"{path}.index" if damaged == "index" else f"{path}.data-00000-of-00001", 0.5)
  optimizer = tfrs_writer.keras_optimizer("adagrad", tf_keras.optimizers.legacy)
  model = tfrs_writer.build_model(
    tpu_embedding.TPUEmbedding(tfrs_writer.feature_config(), optimizer), optimizer, tf_keras
  )
  model(tfrs_writer.inputs())
  before = {v.name: v.numpy() for v in model.variables}
  with pytest.raises(ValueError, match=f"its {damaged} file.*damaged or truncated.*Nothing was"):
    tpu_embedding.restore_checkpoint(tf.train.Checkpoint(model=model, optimizer=optimizer), path)
  for variable in model.variables:
    np.testing.assert_array_equal(variable.numpy(), before[variable.name])
  # A whole copy restores: the same model, tfrs's checkpoint.
  tpu_embedding.restore_checkpoint(
    tf.train.Checkpoint(model=model, optimizer=optimizer), str(tfrs_checkpoint / "ckpt")
  )
  np.testing.assert_array_equal(
    model.dense.kernel.numpy(),
    tf.train.load_variable(
      str(tfrs_checkpoint / "ckpt"), "model/dense/kernel/.ATTRIBUTES/VARIABLE_VALUE"
    ),
  )


NOTHING = "Nothing was restored: every variable of the model is unchanged."


def test_a_model_variable_the_checkpoint_lacks_is_named_and_nothing_is_restored(tmp_path):
  """TF would restore the rest and leave it (`assert_existing_objects_matched` says so only
  afterwards)."""
  path = tf.train.Checkpoint(model=built(seed=1)).save(str(tmp_path / "ckpt"))
  target = built(seed=2)
  target.extra = tf_keras.layers.Dense(2)  # a layer the saved model did not have
  target.extra.build((None, 3))
  before, on_disk = snapshot(target), files(tmp_path)
  with pytest.raises(ValueError) as raised:
    tpu_embedding.restore_checkpoint(target, path)
  assert str(raised.value) == (
    f"Cannot restore the checkpoint {path!r}:\n"
    "  - model/extra/kernel (shape [3, 2], float32) is in the model but not in the checkpoint "
    "(allow_missing= lets it keep its value)\n"
    "  - model/extra/bias (shape [2], float32) is in the model but not in the checkpoint "
    f"(allow_missing= lets it keep its value)\n{NOTHING} Restore a checkpoint written by the "
    "same model."
  )
  assert_same(before, target)
  assert files(tmp_path) == on_disk
  # The opt-out, by path or a prefix of it: everything else restored, `extra` kept.
  for allowed in (["model/extra"], ["model/extra/kernel", "model/extra/bias"], True):
    target = built(seed=2)
    target.extra = tf_keras.layers.Dense(2)
    target.extra.build((None, 3))
    kernel = target.extra.kernel.numpy()
    tpu_embedding.restore_checkpoint(target, path, allow_missing=allowed)
    np.testing.assert_array_equal(target.hidden.kernel.numpy(), built(seed=1).hidden.kernel)
    np.testing.assert_array_equal(target.extra.kernel.numpy(), kernel)
  with pytest.raises(ValueError, match=r"model/extra/bias \(shape \[2\], float32\) is in the"):
    tpu_embedding.restore_checkpoint(target, path, allow_missing=["model/extra/kernel"])


def test_an_optimizer_the_checkpoint_lacks_is_named_unless_allowed(tmp_path):
  """A checkpoint of the model alone, restored into (model, optimizer) after training."""
  path = tf.train.Checkpoint(model=built(seed=1)).save(str(tmp_path / "ckpt"))
  target = built(seed=2)
  optimizer = tf_keras.optimizers.legacy.SGD(0.1)
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(target(IDS))
  optimizer.apply_gradients(
    zip(tape.gradient(loss, target.trainable_variables[-4:]), target.trainable_variables[-4:])
  )
  checkpoint = tf.train.Checkpoint(model=target, optimizer=optimizer)
  before = snapshot(target)
  with pytest.raises(
    ValueError,
    match=r"(?s)  - optimizer/iter \(shape \[\], int64\) is in the "
    r"model but not in the checkpoint.*  - optimizer/learning_rate .*" + NOTHING,
  ):
    tpu_embedding.restore_checkpoint(checkpoint, path)
  assert_same(before, target)
  assert optimizer.iterations.numpy() == 1
  tpu_embedding.restore_checkpoint(checkpoint, path, allow_missing=["optimizer"])
  assert_unchanged(target, values(built(seed=1)))  # restored: the saved model's values
  assert optimizer.iterations.numpy() == 1


def test_a_slot_the_checkpoint_lacks_is_named_by_the_layer_and_nothing_is_restored(tmp_path):
  path = tf.train.Checkpoint(model=built(seed=1, optimizer=E.SGD(0.1))).save(str(tmp_path / "c"))
  target = built(seed=2)  # Adagrad: an accumulator per table
  before = snapshot(target)
  with pytest.raises(
    ValueError,
    match=r"slot 'movie/accumulators' of table 'movie' \(shape \[6, 3\] in this layer\) "
    r"is missing from the checkpoint",
  ):
    tpu_embedding.restore_checkpoint(target, path)
  assert_same(before, target)


@pytest.mark.parametrize("layer_name", ["TPUEmbedding", "PartialTPUEmbedding"])
def test_tfrs_checkpoints_restore_whole_and_one_written_before_training_needs_no_opt_out(
  tfrs_checkpoints,  # noqa: F811  (the fixture imported above)
  layer_name,
):
  """tfrs's Keras optimizer creates its variables at the first step, as ours does: a model that
  has not trained lacks nothing of either checkpoint; one that has trained lacks the optimizer's
  variables in the checkpoint written before training."""
  for trained in (False, True):
    path = tfrs_checkpoints[(layer_name, "adagrad") + (() if trained else ("untrained",))]
    model, optimizer = our_model(layer_name, "adagrad")
    tpu_embedding.restore_checkpoint(tf.train.Checkpoint(model=model, optimizer=optimizer), path)
    np.testing.assert_array_equal(
      model.embedding.variables_by_table["large"]["parameters"].numpy(),
      tf.train.load_variable(path, tfrs_key(layer_name, "large")),
    )
  path = tfrs_checkpoints[(layer_name, "adagrad", "untrained")]
  model, optimizer = our_model(layer_name, "adagrad")
  data = tf.data.Dataset.from_tensors((tfrs_writer.inputs(), tf.constant(tfrs_writer.LABELS)))
  model.fit(data, verbose=0)
  checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
  before = snapshot(model)
  with pytest.raises(
    ValueError, match=r"  - optimizer/iter \(shape \[\], int64\) is in the model but not in the"
  ):
    tpu_embedding.restore_checkpoint(checkpoint, path)
  assert_same(before, model)
  tpu_embedding.restore_checkpoint(checkpoint, path, allow_missing=["optimizer"])
  np.testing.assert_array_equal(
    model.dense.kernel.numpy(),
    tf.train.load_variable(path, "model/dense/kernel/.ATTRIBUTES/VARIABLE_VALUE"),
  )
