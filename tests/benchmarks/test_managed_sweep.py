"""The sweep's comparison: each setting against TorchRec's best variant of a cell, seed by seed."""

from benchmarks import managed_sweep


def test_paired_difference_from_torchrecs_best_by_median():
  ours = {"c": {"a": {0: 0.50, 1: 0.61, 2: 0.40}}}
  theirs = {
    "c": {
      "TorchRec lru, interval 1": [0.52, 0.60, 0.45, 0.0],  # median over seeds 0-2: 0.52
      "TorchRec lfu, interval 1": [0.55, 0.58, 0.41, 9.0],  # 0.55
    }
  }
  entry = managed_sweep.summary(ours, theirs)["c"]["a"]
  assert entry["torchrec_best"] == "TorchRec lru, interval 1"
  assert entry["median"] == 0.50 and entry["torchrec_median"] == 0.52
  # differences -0.02, +0.01, -0.05: median -0.02, lower on two seeds of three
  assert abs(entry["paired_median_difference"] - (-0.02)) < 1e-12
  assert entry["seeds_lower"] == 2 and entry["seeds"] == 3


def test_cells_without_torchrec_runs_give_medians_only():
  entry = managed_sweep.summary({"c": {"a": {0: 0.3, 1: 0.1}}}, {})["c"]["a"]
  assert entry == dict(median=0.2, seeds=2)
