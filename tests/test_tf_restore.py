"""TF's restore internals that `tf_restore` reads: each one asserted here, against a real restore.

A TensorFlow upgrade that renames or moves any of them fails this file (errors, not warnings);
a restore that `tf_restore` cannot find on the stack is refused with an error naming the TF
version the module was checked against.
"""

import inspect
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.checkpoint import restore as tf_restore_internals

import tpu_embedding
from tpu_embedding import tf_restore, tf_versions

E = tf.tpu.experimental.embedding
SEEN = {}  # id(probe) -> what its restore hook saw (kept off the probe: TF would track it)


class Probe(tf_restore.RestoreHook, tf.Module):
  """A trackable whose restore hook records what `tf_restore` and TF's stack show of its restore."""

  def __init__(self, rows):
    super().__init__()
    self.table = tf.Variable(tf.zeros([rows, 2]))

  @property
  def seen(self):
    return SEEN.setdefault(id(self), {})

  def _checkpoint_adapter(self, path):
    restore = tf_restore.restore_of(self)
    children = {child.local_name: child.node_id for child in restore.node.children}
    self.seen["children"] = sorted(children)
    self.seen["table shape"] = restore.stored_shape(restore.nodes[children["table"]])
    self.seen["position"] = _position_on_stack()
    return super()._checkpoint_adapter(path)


def _position_on_stack():
  """The nearest caller's `checkpoint_position`: TF's, from inside the restore hook."""
  frame = sys._getframe(1)
  while tf_restore.POSITION_LOCAL not in frame.f_locals:
    frame = frame.f_back
  return frame.f_locals[tf_restore.POSITION_LOCAL]


def test_checked_tf_version_is_the_installed_one():
  assert tf_versions.minor_version(tf.__version__) in tf_restore.CHECKED_AGAINST, (
    f"tpu_embedding.tf_restore was checked against TF {tf_restore.CHECKED_AGAINST}, this is "
    f"{tf.__version__}: re-check every internal it reads, then add the version."
  )


def test_tf_restore_hook_caller_has_the_position_local():
  # The restore hook came with TF 2.17; before it, `RestoreHook` calls it from the restore walk.
  minor = tuple(int(part) for part in tf_versions.minor_version(tf.__version__).split("."))
  assert tf_restore.HAS_ADAPTER_HOOK == (minor >= (2, 17))
  walk = getattr(tf_restore_internals, tf_restore.RESTORE_WALK)
  assert list(inspect.signature(walk).parameters)[0] == tf_restore.POSITION_LOCAL
  source = inspect.getsource(walk)
  assert source.index("._trackable_children()") < source.index(".object_proto.children")
  if tf_restore.HAS_ADAPTER_HOOK:
    params = list(inspect.signature(tf_restore_internals._maybe_get_adapter).parameters)
    assert params == [tf_restore.POSITION_LOCAL, "trackable"]
    assert "._checkpoint_adapter(" in inspect.getsource(tf_restore_internals._maybe_get_adapter)


def test_the_hook_runs_once_per_restore_of_an_object(tmp_path):
  calls = []

  class Counted(Probe):
    def _checkpoint_adapter(self, path):
      calls.append(path)
      return super()._checkpoint_adapter(path)

  path = tf.train.Checkpoint(probe=Probe(rows=2)).write(str(tmp_path / "ckpt"))
  restored = Counted(rows=2)
  tf.train.Checkpoint(probe=restored).read(path).assert_consumed()
  assert calls == [path]
  tf.train.Checkpoint(probe=restored).write(str(tmp_path / "again"))  # no restore: no call
  assert calls == [path]


def test_real_restore_exposes_what_tf_restore_reads(tmp_path):
  saved = Probe(rows=3)
  path = tf.train.Checkpoint(probe=saved).write(str(tmp_path / "ckpt"))
  restored = Probe(rows=3)
  tf.train.Checkpoint(probe=restored).read(path).assert_consumed()
  assert restored.seen["children"] == ["table"]
  assert restored.seen["table shape"] == [3, 2]
  position = restored.seen["position"]
  assert position.trackable is restored
  coordinator = position.checkpoint
  assert position.object_proto.children[0].local_name == "table"
  for name in ("object_graph_proto", "shape_map", "slot_restorations", "all_python_objects"):
    assert hasattr(coordinator, name), f"TF's restore coordinator lost {name!r}"
  assert isinstance(coordinator.slot_restorations, dict)
  assert any(o is restored for o in coordinator.all_python_objects)


def test_forget_pending_restores_drops_deferred_dependencies(tmp_path):
  saved = Probe(rows=3)
  saved.later = tf.Variable([1.0, 2.0])
  path = tf.train.Checkpoint(probe=saved).write(str(tmp_path / "ckpt"))
  restored = Probe(rows=3)
  tf.train.Checkpoint(probe=restored).read(path).expect_partial()
  deferred = restored._deferred_dependencies  # TF keeps `later` here until it is created
  assert list(deferred) == ["later"]
  assert deferred["later"][0].checkpoint is restored.seen["position"].checkpoint
  tf_restore.Restore(restored.seen["position"]).forget_pending_restores()
  assert "later" not in restored._deferred_dependencies


def test_outside_a_restore_is_an_error_naming_the_checked_version():
  checked = ", ".join(tf_restore.CHECKED_AGAINST)  # e.g. "2.17, 2.18, 2.21"
  with pytest.raises(tf_restore.RestoreMachineryChanged, match=f"against TensorFlow {checked};"):
    tf_restore.restore_of(Probe(rows=1))


def test_restore_refused_when_tf_moves_the_position(tmp_path, monkeypatch):
  """A TF that names the restore's position otherwise: the layer refuses the restore (it cannot
  validate it) and its table keeps its values."""
  config = {"f": E.FeatureConfig(E.TableConfig(6, 2, name="t", optimizer=E.SGD(0.1)))}
  saved = tpu_embedding.TPUEmbedding(config)
  saved({"f": tf.constant([1, 2], tf.int64)})
  path = tf.train.Checkpoint(layer=saved).write(str(tmp_path / "ckpt"))
  layer = tpu_embedding.TPUEmbedding(config)
  layer({"f": tf.constant([1, 2], tf.int64)})
  table = next(iter(layer.embedding_tables.values()))
  table.assign(tf.fill([6, 2], 7.0))

  # As if TF renamed the local of its restore code that holds the position being expanded.
  monkeypatch.setattr(tf_restore, "POSITION_LOCAL", "renamed_by_a_tf_upgrade")
  with pytest.raises(
    tf_restore.RestoreMachineryChanged,
    match=f"TensorFlow {tf.__version__}'s restore machinery changed",
  ):
    tf.train.Checkpoint(layer=layer).read(path)
  np.testing.assert_array_equal(table.numpy(), np.full([6, 2], 7.0))
