"""tpu_embedding.placement: each table's side from its size, the hardware asked once, the report."""

import pytest
import tensorflow as tf

from tpu_embedding import hardware, placement
from tpu_embedding.config import prepare

import tpu_harness

E = tf.tpu.experimental.embedding


def _config():
  small = E.TableConfig(10, 4, name="small")
  large = E.TableConfig(1001, 8, name="large")
  return prepare(
    {"a": E.FeatureConfig(small), "b": E.FeatureConfig(large), "c": E.FeatureConfig(large)},
    E.Adagrad(0.1),
  )


@pytest.mark.parametrize(
  "threshold,want",
  [
    (10, {"small": "replicated", "large": "sharded"}),
    (1001, {"small": "replicated", "large": "replicated"}),
    (0, {"small": "sharded", "large": "sharded"}),
    (None, {"small": "replicated", "large": "replicated"}),
  ],
)
def test_sides_follow_vocabulary_size_strictly_above_the_threshold(threshold, want):
  assert placement.sides(_config(), threshold) == want


@pytest.mark.parametrize("threshold", [-1, 1.5, True, "10"])
def test_a_bad_threshold_is_refused(threshold):
  with pytest.raises(ValueError, match=f"size_threshold={threshold!r}; expected an int >= 0"):
    placement.sides(_config(), threshold)


def test_report_counts_table_and_slots_per_device():
  config = _config()
  report = placement.report(config, placement.sides(config, 10), 10, num_replicas=4)
  small, large = report["small"], report["large"]
  # Adagrad: one accumulator per row, as wide as the table: 2 * dim float32 per row.
  assert (small.bytes, small.bytes_per_device) == (10 * 2 * 4 * 4, 10 * 2 * 4 * 4)
  assert (large.bytes, large.bytes_per_device) == (1001 * 2 * 8 * 4, 251 * 2 * 8 * 4)
  assert large.features == ("b", "c") and large.slots == ("accumulators",)
  assert report.bytes_per_device() == 320 + 16064


def test_the_sharded_path_is_refused_without_embedding_hardware(monkeypatch):
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.UNSUPPORTED)
  with pytest.raises(ValueError, match=r"Features \['b'\] would be sharded.*nothing to shard"):
    placement.sharded_path(strategy, ["b"])


def test_the_sharded_path_is_the_hardwares(monkeypatch):
  assert placement.sharded_path(tf.distribute.get_strategy(), ["b"]) is hardware.ExecutionPath.CPU
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V2)
  assert placement.sharded_path(strategy, ["b"]) is hardware.ExecutionPath.TPU_V2
