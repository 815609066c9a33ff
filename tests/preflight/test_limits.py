"""`preflight.sparse_core_config`, `preview_limits` and `emulate_id_dropping`: the headroom
rule by hand, the config on TF's real `TPUEmbeddingV2` (the limits it traces into its
preprocessing ops), failures and drops worked by hand and against a replay of TF's packing loop
(tests/support/sparse_core_reference.py)."""

import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding import hardware, preflight, tf_internals
from tpu_embedding.layer import TPUEmbedding

import sparse_core_reference
import tpu_harness

emb = tf.tpu.experimental.embedding
pytestmark = pytest.mark.skipif(
  tf_internals.SPARSE_CORE_CONFIG is None, reason=f"no SparseCore limits on TF {tf.__version__}"
)
STATS = {
  "a_b": {"max_ids_per_partition": 10, "max_unique_ids_per_partition": 7},
  "c": {"max_ids_per_partition": 0, "max_unique_ids_per_partition": 0},
  "max_ids_per_chip_per_sample": 5,
}


def test_headroom_rule_worked_by_hand():
  """ceil(10 * 1.25) = 13, ceil(7 * 1.25) = 9, an unused table 1 (TF refuses 0); the per-chip
  figure ceil(5 * 1.25) = 7 rounded up to 8."""
  config = preflight.sparse_core_config(STATS)
  assert config.max_ids_per_table == {"a_b": 13, "c": 1}
  assert config.max_unique_ids_per_table == {"a_b": 9, "c": 1}
  assert config.max_ids_per_chip_per_sample == 8
  assert (config.disable_table_stacking, config.allow_id_dropping) == (False, False)
  exact = preflight.sparse_core_config(STATS, headroom=0, stacking=False, allow_id_dropping=True)
  assert exact.max_ids_per_table == {"a_b": 10, "c": 1}
  assert exact.max_unique_ids_per_table == {"a_b": 7, "c": 1}
  assert exact.max_ids_per_chip_per_sample == 5
  assert (exact.disable_table_stacking, exact.allow_id_dropping) == (True, True)


@pytest.mark.parametrize(
  "stats,kwargs,message",
  [
    (STATS, {"headroom": -0.1}, "headroom must be a number >= 0; got -0.1"),
    (STATS, {"headroom": "10%"}, "headroom must be a number >= 0"),
    ({"a": {}}, {}, "stats must be what sparse_core_stats returns"),
    ({**STATS, "max_ids_per_chip_per_sample": 0}, {}, "max_ids_per_chip_per_sample must be a"),
    ({**STATS, "c": {"max_ids_per_partition": 1}}, {}, r"stats\['c'\] must hold"),
    (
      {**STATS, "c": {"max_ids_per_partition": -1, "max_unique_ids_per_partition": 0}},
      {},
      r"stats\['c'\]\['max_ids_per_partition'\] must be a whole number >= 0; got -1",
    ),
  ],
)
def test_bad_stats_or_headroom_are_refused(stats, kwargs, message):
  with pytest.raises(ValueError, match=message):
    preflight.sparse_core_config(stats, **kwargs)


def _traced_limits(mid_level, batch):
  """{op type: {table: the limits TF traced into that preprocessing op}} from tracing
  `enqueue` (built, never run: its kernels need a TPU host)."""
  specs = tf.nest.map_structure(tf.TensorSpec.from_tensor, batch)
  graph = tf.function(mid_level.enqueue).get_concrete_function(specs).graph
  traced = {}
  for op in graph.get_operations():
    if op.type == "SortListOfSparseCoreCooTensors":
      traced.setdefault("sort", {})[op.get_attr("table_name").decode()] = (
        op.get_attr("max_ids_per_sparse_core"),
        op.get_attr("max_unique_ids_per_sparse_core"),
      )
    if op.type == "ConvertToSparseCoreCsrWrappedCooTensor":
      traced.setdefault("pack", {})[op.get_attr("table_name").decode()] = (
        op.get_attr("max_ids_per_chip_per_sample"),
        op.get_attr("allow_id_dropping"),
      )
  return traced


@pytest.mark.parametrize("stacking", [True, False], ids=["stacked", "unstacked"])
def test_tfs_tpu_embedding_v2_takes_the_config_with_the_stacked_names(monkeypatch, stacking):
  """The layer on TF's real TPUEmbeddingV2 (2 chips, stand-in strategy) traces our limits into
  its preprocessing ops for every stacked table: none falls back to TF's 256."""
  tables = [emb.TableConfig(64, 4, name=name) for name in ("video", "user")]
  config = {"x": emb.FeatureConfig(tables[0]), "y": emb.FeatureConfig(tables[1])}
  rng = np.random.default_rng(0)
  batches = [{k: tf.constant(rng.integers(0, 64, 16)) for k in config} for _ in range(3)]
  stats = preflight.sparse_core_stats(config, batches, num_chips=2, stacking=stacking)
  sc_config = preflight.sparse_core_config(stats, headroom=0.5, stacking=stacking)
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V2, 2)
  per_chip = {
    k: emb.FeatureConfig(f.table, output_shape=[8]) for k, f in config.items()
  }  # 16 global samples on 2 chips
  with strategy.scope():
    layer = TPUEmbedding(per_chip, optimizer="adagrad", sparse_core_embedding_config=sc_config)
    layer.build({k: tf.TensorShape([8]) for k in config})
  traced = _traced_limits(layer.engine, {k: v[:8] for k, v in batches[0].items()})
  names = set(stats) - {"max_ids_per_chip_per_sample"}
  assert names == ({"user_video"} if stacking else {"video", "user"})
  assert traced["sort"] == {
    name: (sc_config.max_ids_per_table[name], sc_config.max_unique_ids_per_table[name])
    for name in names
  }
  assert traced["pack"] == {name: (sc_config.max_ids_per_chip_per_sample, False) for name in names}
  assert all(limit != 256 for limits in traced["sort"].values() for limit in limits)


HAND = {"f": np.array([0, 4, 1, 1, 2, 3, 8, 12])}  # tests/preflight/test_input_stats.py's


def _one_table():
  return {"f": emb.FeatureConfig(emb.TableConfig(64, 4, name="t"))}


def test_failures_worked_by_hand():
  """Per partition, SparseCores 0, 1 and 3 send 2 ids (1 over a limit of 1; the first is
  SparseCore 0's partition 0), SparseCores 0 and 3 two unique ids; the buffer of 4 * 8 = 32 ids
  needs 34 (test_input_stats.test_worked_by_hand), and drops the last run's 2 ids."""
  config = emb.SparseCoreEmbeddingConfig(
    max_ids_per_chip_per_sample=4, max_ids_per_table={"t": 1}, max_unique_ids_per_table={"t": 1}
  )
  preview = preflight.preview_limits(_one_table(), [HAND, HAND], config, num_chips=1)
  F = preflight.Failure
  for batch in (0, 1):
    assert preview.failures[3 * batch : 3 * batch + 3] == (
      F(batch, "t", "max_ids_per_table", 1, 2, 0, 0, 0, 3),
      F(batch, "t", "max_unique_ids_per_table", 1, 2, 0, 0, 0, 2),
      F(batch, "t", "max_ids_per_chip", 32, 34, 0, None, None, 1),
    )
  assert preview.failures[0].excess == 1
  assert preview.failed_batches == [0, 1]
  assert (preview.batches, preview.ids, preview.dropped) == (2, 16, {"t": 4})
  assert "batch 0, table 't': 2 > max_ids_per_table 1 (by 1)" in preview.summary()


@pytest.mark.parametrize("per_sample,dropped", [(5, 0), (4, 2), (3, 3), (1, 6)])
def test_drops_worked_by_hand(per_sample, dropped):
  """Buffers of 40, 32, 24 and 8 ids over runs 2 | 2 | 1, 1 | 2, each padded to 8: nothing,
  the last run, the last two runs, all after the first run."""
  config = emb.SparseCoreEmbeddingConfig(max_ids_per_chip_per_sample=per_sample)
  preview = preflight.preview_limits(_one_table(), [HAND], config, num_chips=1)
  assert preview.dropped == {"t": dropped}
  assert preview.failed_batches == ([] if dropped == 0 else [0])
  dropping = emb.SparseCoreEmbeddingConfig(
    max_ids_per_chip_per_sample=per_sample, allow_id_dropping=True
  )
  assert preflight.preview_limits(_one_table(), [HAND], dropping, num_chips=1).failures == ()
  (emulated,) = preflight.emulate_id_dropping(_one_table(), [HAND], dropping, num_chips=1)
  # The kept ids are the first in TF's order: SparseCore by SparseCore, partition by partition.
  kept = {5: 8, 4: 6, 3: 5, 1: 2}[per_sample]
  want = [[int(v)] if i < kept else [] for i, v in enumerate(HAND["f"])]
  assert emulated["f"].to_list() == want


def test_tf_defaults_are_256_and_64_and_table_names_of_a_stack_are_ignored():
  """max_ids_per_table names a table TF stacked: TF looks the stack up, gives it 256."""
  tables = [emb.TableConfig(64, 4, name=name) for name in ("a", "b")]
  config = {"x": emb.FeatureConfig(tables[0]), "y": emb.FeatureConfig(tables[1])}
  batch = {"x": np.zeros(8, np.int64), "y": np.zeros(8, np.int64)}  # 2 ids a SparseCore sends
  named = emb.SparseCoreEmbeddingConfig(max_ids_per_table={"a": 1})
  preview = preflight.preview_limits(config, [batch], named, num_chips=1)
  assert (preview.failures, preview.unmatched_names) == ((), ("a",))
  assert "TF gives those stacks 256" in preview.summary()
  stacked = emb.SparseCoreEmbeddingConfig(max_ids_per_table={"a_b": 3})
  assert preflight.preview_limits(config, [batch], stacked, num_chips=1).failures[0].count == 4
  assert preflight.preview_limits(config, [batch], None, num_chips=1).failures == ()


@pytest.mark.parametrize(
  "config,message",
  [
    (
      emb.SparseCoreEmbeddingConfig(max_ids_per_chip_per_sample=1),
      r"1 \* 12 samples per chip of table 't' = 12 ids, not a multiple of 8",
    ),
    (emb.SparseCoreEmbeddingConfig(max_ids_per_chip_per_sample=0), "must be a whole number >= 1"),
    (
      emb.SparseCoreEmbeddingConfig(max_unique_ids_per_table={"t": 0}),
      r"max_unique_ids_per_table\['t'\] must be a whole number >= 1; got 0",
    ),
    ({"max_ids_per_table": {"t": 8}}, "config must be a SparseCoreEmbeddingConfig or None"),
  ],
)
def test_limits_tf_refuses_are_refused(config, message):
  with pytest.raises(ValueError, match=message):
    preflight.preview_limits(_one_table(), [{"f": np.arange(12)}], config, num_chips=1)


def test_emulation_refuses_a_config_that_does_not_drop_and_batches_that_fail():
  with pytest.raises(ValueError, match="allow_id_dropping=True"):
    next(preflight.emulate_id_dropping(_one_table(), [HAND], None, num_chips=1))
  failing = emb.SparseCoreEmbeddingConfig(max_ids_per_table={"t": 1}, allow_id_dropping=True)
  with pytest.raises(ValueError, match="Batch 0 fails the step.*'t' sends 2 ids"):
    next(preflight.emulate_id_dropping(_one_table(), [HAND], failing, num_chips=1))


def _zipf_config():
  video = emb.TableConfig(500, 8, name="video")
  user = emb.TableConfig(200, 8, name="user")
  return {
    "clicked": emb.FeatureConfig(video),
    "user": emb.FeatureConfig(user),
    "watched": emb.FeatureConfig(video),
  }


def _zipf_batches(chips, seed=0, count=2):
  rng = np.random.default_rng(seed)
  zipf = lambda size, vocabulary: np.minimum(rng.zipf(1.2, size) - 1, vocabulary - 1)
  rows = 32 * chips
  for _ in range(count):
    lengths = rng.integers(0, 5, rows)
    yield {
      "clicked": zipf(rows, 500),
      "user": zipf(rows, 200),
      "watched": tf.RaggedTensor.from_row_lengths(zipf(int(lengths.sum()), 500), lengths),
    }


@pytest.mark.parametrize("chips", [1, 4])
@pytest.mark.parametrize("per_sample", [1, 2])
def test_dropped_ids_match_a_replay_of_tfs_packing_loop(chips, per_sample):
  config = _zipf_config()
  dropping = emb.SparseCoreEmbeddingConfig(
    max_ids_per_chip_per_sample=per_sample,
    max_ids_per_table={"user_video": 10**6},
    max_unique_ids_per_table={"user_video": 10**6},
    allow_id_dropping=True,
  )
  samples = {path: 32 for path in config}
  table_layouts = sparse_core_reference.layouts(config, chips, 4, True, samples)
  emulated = preflight.emulate_id_dropping(config, _zipf_batches(chips), dropping, num_chips=chips)
  preview = preflight.preview_limits(config, _zipf_batches(chips), dropping, num_chips=chips)
  total = 0
  for batch, got in zip(_zipf_batches(chips), emulated):
    lost = sparse_core_reference.dropped_ids(config, batch, table_layouts, chips, 4, per_sample)
    total += len(lost)
    for path in config:
      want = [
        [i for i in ids if (path, sample, i) not in lost]
        for sample, ids in enumerate(sparse_core_reference.id_lists(batch[path]))
      ]
      assert got[path].to_list() == want, path
  assert preview.dropped == {"user_video": total}
  assert total > 0 or per_sample > 1  # one id a sample leaves no room for the padding
