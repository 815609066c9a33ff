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
from test_checkpoints import tfrs_checkpoints  # noqa: E402, F401  (a fixture: files tfrs writes)

import tfrs_checkpoint_writer as tfrs_writer  # noqa: E402

E = tf.tpu.experimental.embedding
IDS = {"user": tf.constant([1, 2, 3]), "movie": tf.constant([0, 4, 4])}


class Ranker(tf_keras.Model):
  def __init__(self, hidden=4, seed=0):
    super().__init__()
    tf.keras.utils.set_random_seed(seed)
    self.embedding = tpu_embedding.TPUEmbedding(
      {
        "user": E.FeatureConfig(E.TableConfig(10, 2, name="user")),
        "movie": E.FeatureConfig(E.TableConfig(6, 3, name="movie")),
      },
      E.Adagrad(0.1),
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
