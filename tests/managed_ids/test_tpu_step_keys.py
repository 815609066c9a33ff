"""Raw keys inside a TPU step, on TF's real V1 `TPUEmbedding` and SparseCore `TPUEmbeddingV2`:
`strategy.run` builds the step as TF's `TPUStrategy.run` builds it for TPU cores (`tpu.replicate`,
host work in outside compilation; tests/tpu_harness.py, traced, never run). Raw keys there are
refused before any map changes, naming the layer and the remedy; the remedy's step (the global
batch remapped on the host before it) keeps the hand-over of ids to the TPU on the host, once,
and no hash table anywhere in the step. Why the maps cannot step inside a TPU step:
docs/managed-ids.md, "Raw keys inside strategy.run and model.fit (issue 44)"."""

import pytest
import tensorflow as tf

import tpu_embedding
from tpu_embedding import hardware

import tpu_harness
from managed_ids_reference import ReferenceMap

E = tf.tpu.experimental.embedding
REPLICAS, BATCH, CAPACITY = 2, 4, 6  # BATCH: each replica's share
GLOBAL_KEYS = [9_123_456_789_012, -7, 3, -7, 77, 3, 11, 2**40]
# Per path: its feature, the op that hands a replica's ids to the TPU (run on the host, in
# outside compilation) and the TPU ops of its lookup and of its update.
PATHS = {
  "V1": (
    hardware.EmbeddingFeature.V1,
    "EnqueueTPUEmbeddingArbitraryTensorBatch",
    ("RecvTPUEmbeddingActivations", "SendTPUEmbeddingGradients"),
  ),
  "V2": (
    hardware.EmbeddingFeature.V2,
    "ConvertToSparseCoreCsrWrappedCooTensor",
    ("XlaSparseDenseMatmulWithStaticBufferSize",),
  ),
}


@pytest.fixture(params=sorted(PATHS))
def tpu_layer(request, monkeypatch):
  """(path, strategy, layer) on each path."""
  return (request.param, *_managed_layer(monkeypatch, request.param))


def _managed_layer(monkeypatch, path):
  """(strategy, layer): a managed table under a stand-in TPU whose steps are replicated."""
  feature, _, _ = PATHS[path]
  strategy, _ = tpu_harness.tpu_strategy(
    monkeypatch, feature, replicas=REPLICAS, replicated_steps=True
  )
  table = E.TableConfig(CAPACITY, 4, name="movies")
  with strategy.scope():
    layer = tpu_embedding.TPUEmbedding(
      {"movie": E.FeatureConfig(table, name="movie", output_shape=[BATCH])},
      optimizer=E.SGD(0.1),
      managed_ids={"movies": tpu_embedding.ManagedIds(eviction="lru")},
      name="ratings",
    )
    layer.build({"movie": tf.TensorShape([BATCH])})
  return strategy, layer


def test_raw_keys_in_a_replicated_tpu_step_are_refused_and_change_nothing(tpu_layer):
  _, strategy, layer = tpu_layer
  step = tpu_harness.training_step(strategy, layer, remapped=False)
  with strategy.scope():
    with pytest.raises(
      ValueError, match=r"'ratings'.*raw keys inside a TPU step.*layer\.remap.*remapped=True"
    ):
      step.get_concrete_function({"movie": tf.TensorSpec([BATCH], tf.int64)})
  assert int(layer.managed_ids["movies"].size()) == 0


def test_the_remedy_hands_rows_to_the_tpu_on_the_host_once_with_no_hash_table(tpu_layer):
  path, strategy, layer = tpu_layer
  _, host_op, tpu_ops = PATHS[path]
  with strategy.scope():
    rows = layer.remap({"movie": tf.constant(GLOBAL_KEYS, tf.int64)})["movie"]
  assert rows.numpy().tolist() == ReferenceMap(CAPACITY, "lru").train(GLOBAL_KEYS)[0]
  step = tpu_harness.training_step(strategy, layer, remapped=True)
  with strategy.scope():
    graph = step.get_concrete_function({"movie": tf.TensorSpec([BATCH], tf.int64)}).graph
  assert [op.type for op in graph.get_operations()].count("TPUReplicateMetadata") == 1
  on_host = [op for op in graph.get_operations() if "_xla_outside_compilation" in op.node_def.attr]
  assert [op.type for op in on_host].count(host_op) == 1
  types = [op.type for op in graph.get_operations()]
  assert [types.count(t) for t in tpu_ops] == [1] * len(tpu_ops)
  assert not [op for op in on_host if op.type in tpu_ops]  # the lookup and update: on the TPU
  assert not [t for t in types if "HashTable" in t]


# What the refusal rests on: TF's own behaviour inside a TPU step (docs/managed-ids.md). If a TF
# release changes either, the maps might step there after all.


def test_host_code_inside_a_tpu_step_sees_one_replicas_keys_only(monkeypatch):
  """A merge_call (how one map step serves all replicas under MirroredStrategy) hands a TPU
  step's cross-replica code one replica's value: the step is traced once for all replicas."""
  strategy, _ = tpu_harness.tpu_strategy(
    monkeypatch, hardware.EmbeddingFeature.V1, replicas=REPLICAS, replicated_steps=True
  )
  seen = []

  def replica_step(keys):
    def merge(strategy, keys):
      seen.append(len(strategy.experimental_local_results(keys)))
      return keys

    return tf.distribute.get_replica_context().merge_call(merge, args=(keys,))

  @tf.function  # named: TF names the TPU computation after it
  def step(keys):
    return strategy.run(replica_step, args=(keys,))

  with strategy.scope():
    step.get_concrete_function(tf.TensorSpec([BATCH], tf.int64))
  assert strategy.num_replicas_in_sync == 2 and seen == [1]


def test_tf_v1_enqueue_inside_a_tpu_step_takes_only_the_steps_own_inputs(monkeypatch):
  """Rows computed inside the step, even on the host (outside compilation), are refused by TF's
  V1 class: its enqueue must be extractable to the head of the TPU computation."""
  strategy, layer = _managed_layer(monkeypatch, "V1")

  def replica_step(keys):
    def on_host(keys):
      return keys % CAPACITY

    rows = tf.compat.v1.tpu.outside_compilation(on_host, keys)
    layer.engine.enqueue({"movie": rows}, name="1")
    return layer.engine.dequeue(name="1")["movie"]

  @tf.function  # named: TF names the TPU computation after it
  def step(keys):
    return strategy.run(replica_step, args=(keys,))

  with strategy.scope():
    with pytest.raises(ValueError, match=r"_tpu_input_identity"):
      step.get_concrete_function(tf.TensorSpec([BATCH], tf.int64))
