"""Each TF internal behind `tpu_embedding.tf_internals`, exercised on the installed TensorFlow.

The version matrix (.ci/matrix) runs this file under every supported TF: an internal that moved
or changed meaning fails here by name.
"""

import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding import hardware, tf_internals, tf_versions
from tpu_embedding.layer import TPUEmbedding

import tpu_harness

emb = tf.tpu.experimental.embedding
MINOR = tuple(int(part) for part in tf_versions.minor_version(tf.__version__).split("."))


def test_nest_paths_flattening_and_structures_up_to():
  nest = {"b": 3, "a": [1, {"c": 2}]}
  assert tf_internals.flatten_with_paths(nest) == [("a/0", 1), ("a/1/c", 2), ("b", 3)]
  assert tf_internals.flatten_up_to({"a": 0, "b": 0}, {"a": [1, 2], "b": (3,)}) == [[1, 2], (3,)]
  assert tf_internals.map_structure_up_to({"a": 0}, len, {"a": [1, 2, 3]}) == {"a": 3}
  # list and tuple are the same structure here (Keras 3 gives shapes as tuples)
  assert tf_internals.flatten_up_to([0, 0], (5, 6)) == [5, 6]


def test_save_context_is_seen_only_while_a_saved_model_is_traced(tmp_path):
  seen = []

  class Model(tf.Module):
    @tf.function(input_signature=[])
    def serve(self):
      seen.append(tf_internals.in_save_context())
      return tf.constant(1.0)

  assert not tf_internals.in_save_context()
  tf.saved_model.save(Model(), str(tmp_path / "model"))
  assert seen and all(seen)


def test_could_possibly_record_only_under_a_tape():
  assert not tf_internals.could_possibly_record()
  with tf.GradientTape():
    assert tf_internals.could_possibly_record()


def test_compiling_with_xla_only_inside_jit_compiled_functions():
  seen = {}

  def probe(key):
    seen[key] = tf_internals.compiling_with_xla()
    return tf.constant(0.0)

  tf.function(lambda: probe("jit"), jit_compile=True)()
  tf.function(lambda: probe("graph"))()
  assert seen == {"jit": True, "graph": False}
  assert not tf_internals.compiling_with_xla()


def test_control_dependencies_are_added_in_functions_only():
  seen = {}

  def probe(key):
    seen[key] = tf_internals.adds_control_dependencies()
    return tf.constant(0.0)

  tf.function(lambda: probe("function"))()
  with tf.Graph().as_default():
    probe("graph")
  probe("eager")
  assert seen == {"function": True, "graph": False, "eager": False}


def test_host_address_space_names_this_process():
  spec = tf.DeviceSpec.from_string(tf_internals.host_address_space())
  assert (spec.job, spec.replica, spec.task) == ("localhost", 0, 0)


def test_kernel_device_types():
  assert "CPU" in tf_internals.kernel_device_types("MatMul")
  assert "CPU" not in tf_internals.kernel_device_types("TPUReplicatedInput")


def test_uninitialized_variable_takes_its_value_from_an_assign():
  variable = tf_internals.uninitialized_variable(shape=[2, 3], dtype=tf.float32, name="x")
  variable.assign(tf.ones([2, 3]))
  np.testing.assert_array_equal(variable.numpy(), np.ones([2, 3]))


def test_undistributed_variables_are_plain_yet_owned_by_the_strategy_in_scope():
  strategy = tf.distribute.MirroredStrategy(
    ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
  )
  with strategy.scope():
    with tf_internals.undistributed_variables(), tf.device("/cpu:1"):
      plain = tf.Variable([1, 2])
    mirrored = tf.Variable([1, 2])
  assert not isinstance(plain, tf.distribute.DistributedValues)
  assert isinstance(mirrored, tf.distribute.DistributedValues)
  assert tf.DeviceSpec.from_string(plain.device).device_index == 1
  assert strategy.extended.variable_created_in_scope(plain)
  np.testing.assert_array_equal(plain.numpy(), [1, 2])


def test_slot_names_and_initializers_of_the_mid_level_optimizers():
  adam = emb.Adam(0.1)
  assert tf_internals.slot_names(emb.SGD(0.1)) == []
  assert tf_internals.slot_names(emb.Adagrad(0.1)) == ["accumulators"]
  assert tf_internals.slot_names(adam) == ["momenta", "velocities"]
  initializers = tf_internals.slot_initializers(emb.Adagrad(0.1, initial_accumulator_value=0.25))
  assert len(initializers) == 1
  np.testing.assert_allclose(initializers[0]([2, 2], tf.float32).numpy(), np.full([2, 2], 0.25))


def test_packing_status_and_sharded_variables():
  assert tf_internals.PackingStatus.UNSPECIFIED != tf_internals.PackingStatus.ENABLED
  parts = [tf.Variable(tf.zeros([2, 3])), tf.Variable(tf.ones([1, 3]))]
  sharded = tf_internals.ShardedVariable(parts)
  assert sharded.shape == [3, 3] and sharded.variables == parts


def test_escape_checkpoint_name():
  assert tf_internals.escape_checkpoint_name("a/b.c") == "a.Sb..c"


def test_custom_optimizer_where_this_tf_has_it():
  # The mid-level CustomOptimizer came with TF 2.18.
  assert (tf_internals.CUSTOM_OPTIMIZER is not None) == (MINOR >= (2, 18))
  assert tf_internals.CUSTOM_OPTIMIZER is getattr(emb, "CustomOptimizer", None)


def test_sparse_core_where_this_tf_can_restore_it(monkeypatch):
  # SparseCore's checkpoint adapter came with TF 2.17; without it the SparseCore path is refused.
  assert (tf_internals.SPARSE_CORE_CHECKPOINTS is not None) == (MINOR >= (2, 17))
  if tf_internals.SPARSE_CORE_CHECKPOINTS is not None:
    return
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V2)
  config = {"f": emb.FeatureConfig(emb.TableConfig(8, 2, name="t"))}
  with strategy.scope(), pytest.raises(RuntimeError, match="needs TensorFlow 2.17 or later"):
    TPUEmbedding(config, optimizer="sgd")


@pytest.mark.skipif(not tf_internals.HAS_SPARSE_CORE, reason="TF 2.15 has no SparseCore")
def test_sparse_core_helpers():
  from tensorflow.python.tpu import tpu_embedding_v3_utils

  padded = tf.reshape(tf.range(12.0), [3, 4])
  np.testing.assert_array_equal(
    tf_internals.remove_sparse_core_padding(padded, (2, 3)).numpy(), padded.numpy()[:2, :3]
  )
  assert list(tf_internals.sparse_core_layouts(b"").tables) == []
  assert tf_internals.SPARSE_CORE_LAYOUTS_KEY == (
    tpu_embedding_v3_utils.SPARSECORE_LAYOUTS_CHECKPOINT_KEY
  )


@pytest.mark.skipif(tf_internals.SPARSE_CORE_CONFIG is None, reason="no SparseCore limits here")
def test_sparse_core_stacking_is_tfs_on_clones():
  """TF's stacker on 2 chips of 4 SparseCores: "a" and "b" (same optimizer) share the stack
  "a_b", "b" after "a"'s 64 padded rows (8 a shard: column offset 8 * 8) and rotated by 4;
  "c" (another optimizer) alone. The user's tables keep their sizes and optimizers."""
  tables = [emb.TableConfig(64, 4, name=n) for n in "ab"]
  tables.append(emb.TableConfig(16, 4, name="c", optimizer=emb.SGD(0.5)))
  config = {t.name: emb.FeatureConfig(t, output_shape=[8]) for t in tables}
  stacking, flat = tf_internals.sparse_core_stacking(
    config, emb.Adagrad(0.1), 2, 4, tf_internals.sparse_core_config()
  )
  assert [path for path, _ in flat] == ["a", "b", "c"]
  assert stacking.table_to_stacked_table_offset == {
    "a": ("a_b", 0, 0),
    "b": ("a_b", 64, 4),
    "c": ("c", 0, 0),
  }
  assert stacking.table_to_sample_count == {"a_b": 16, "c": 8}
  assert [(t.vocabulary_size, t.dim, t.optimizer) for t in tables[:2]] == [(64, 4, None)] * 2


def test_sparse_core_limits_exist_from_tf_2_17():
  assert (tf_internals.SPARSE_CORE_CONFIG is not None) == (MINOR >= (2, 17))
  if tf_internals.SPARSE_CORE_CONFIG is not None:
    limits = tf_internals.sparse_core_config(max_ids_per_chip_per_sample=8)
    assert isinstance(limits, emb.SparseCoreEmbeddingConfig)
    assert limits.max_ids_per_chip_per_sample == 8
    return
  # TF 2.15 and 2.16: the pre-flight's stacking and limits are refused, naming the version.
  table = emb.TableConfig(8, 4, name="t")
  config = {"f": emb.FeatureConfig(table, output_shape=[8])}
  for call in (
    lambda: tf_internals.sparse_core_config(),
    lambda: tf_internals.sparse_core_stacking(config, emb.SGD(0.1), 1, 4, None),
  ):
    with pytest.raises(tf_internals.NoSparseCore, match="came with TensorFlow 2.17"):
      call()


def test_sparse_core_exists_from_tf_2_16():
  assert tf_internals.HAS_SPARSE_CORE == (MINOR >= (2, 16))
  assert tf_internals.HAS_SPARSE_CORE == hasattr(emb, "TPUEmbeddingV2")


@pytest.mark.skipif(tf_internals.HAS_SPARSE_CORE, reason="this TF reads SparseCore layouts")
def test_without_sparse_core_a_checkpoint_of_stacked_tables_is_refused_unchanged(tmp_path):
  # A checkpoint that a SparseCore layer of a later TF wrote holds its layouts under this name;
  # TF 2.15 cannot parse them, so it cannot tell which tables are stacked: the restore stops.
  def layer(value):
    table = emb.TableConfig(4, 2, name="t", initializer=tf.constant_initializer(value))
    built = TPUEmbedding({"f": emb.FeatureConfig(table)}, optimizer="sgd")
    built({"f": tf.constant([0], tf.int64)})
    return built

  sparse_core_layer = tf.Module()
  setattr(sparse_core_layer, tf_internals.SPARSE_CORE_LAYOUTS_KEY, tf.Variable(b"layouts"))
  path = tf.train.Checkpoint(layer=layer(1.0), other=sparse_core_layer).write(str(tmp_path / "c"))
  receiver = layer(2.0)
  with pytest.raises(tf_internals.NoSparseCore, match=f"TensorFlow {tf.__version__} has no Sp"):
    tf.train.Checkpoint(layer=receiver).restore(path)
  table = next(iter(receiver.embedding_tables.values()))
  np.testing.assert_array_equal(table.numpy(), np.full((4, 2), 2.0))
