"""The sweep's comparison: each setting against TorchRec's best variant of a cell, seed by seed."""

import json

import pytest

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


@pytest.mark.parametrize("split", ["time", "user_time"])
def test_report_pairs_runs_in_a_folder_with_a_given_torchrec_run(tmp_path, split):
  cell = managed_sweep.cell_name(split, 4)
  with open(tmp_path / "runs-x.jsonl", "w") as f:
    for seed, metric in enumerate([0.20, 0.30]):
      line = dict(cell=cell, variant="lfu compete (default)", seed=seed, metric=metric)
      f.write(json.dumps(line) + "\n")
  variants = {
    "TorchRec lfu, interval 2": [0.25, 0.25],
    "hashing trick": [0.40, 0.40],
    "full vocabulary": [0.10, 0.10],
  }
  theirs = tmp_path / "torchrec.json"
  runs = {v: {"metric": m} for v, m in variants.items()}
  cells = {f"MovieLens (local) {split}, 1/4": {"variants": runs}}
  theirs.write_text(json.dumps({"quality": {"cells": cells}}))
  seen = tmp_path / "seen.json"  # another split's cell, from a second TorchRec run
  seen_cells = {"MovieLens (local) time-seen, 1/8": {"variants": runs}}
  seen.write_text(json.dumps({"quality": {"cells": seen_cells}}))
  with open(tmp_path / "runs-x.jsonl", "a") as f:
    line = dict(cell="MovieLens time-seen, 1/8", variant="lfu compete (default)", seed=0)
    f.write(json.dumps(dict(line, metric=0.26)) + "\n")
  text = managed_sweep.report("cmd", str(tmp_path), f"{theirs};{seen}")
  assert f"| setting | MovieLens {split}, 1/4 | MovieLens time-seen, 1/8 |" in text
  assert "| lfu compete (default) | 0.2500 (+0.0000, 1/2) | 0.2600 (+0.0100, 0/1) |" in text
  assert "the real MovieLens 100K" in text and "intervals 1, 2 and 10" in text
  # {split}, 1/4: paired differences -0.05, +0.05: median 0, a share of the gap of 0.3; time-seen,
  # 1/8: +0.01 (of 0.3: 3.3 %), the worst cell
  assert "lfu compete (default): +3.3% (MovieLens time-seen, 1/8)" in text
  assert json.loads((tmp_path / "results.json").read_text())["winners"] == []


def test_no_share_of_a_gap_the_wrong_way():
  ours = {"c": {"a": {0: 0.3}}}
  theirs = {
    "c": {"TorchRec lfu, interval 1": [0.31], "hashing trick": [0.2], "full vocabulary": [0.3]}
  }
  entry = managed_sweep.summary(ours, theirs)["c"]["a"]
  assert "share_of_gap" not in entry and entry["seeds_lower"] == 1


def test_splits_pick_the_movielens_cells_a_run_goes_through(monkeypatch, tmp_path):
  ran = []
  monkeypatch.setattr(managed_sweep, "run", lambda *args: ran.append(args[-1]))
  out = ["--out", str(tmp_path), "--settings", "lru"]
  managed_sweep.main(out + ["--splits", "user_time", "--movielens-only"])
  managed_sweep.main(out)
  assert ran[0] == [("user_time", 8), ("user_time", 4), ("user_time", 2)]
  assert ran[1] == managed_sweep.CELLS and ("drift", 8) in ran[1]
