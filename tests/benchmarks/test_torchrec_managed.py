"""The comparison's adapter: the rows TorchRec's module chose, fed to our layer as they are, and
the rows it evicted reset before the step that reads them (no TorchRec needed: its choice is
written here by hand)."""

import json

import numpy as np
import tensorflow as tf

from benchmarks import managed_policies as mp
from benchmarks import torchrec_managed, torchrec_mch

CAPACITY = 6


def _feed():
  chosen = torchrec_mch.Chosen(
    ids=[np.array([0, 1, 5, 0]), np.array([2, 0, 1])],  # slot 5 = TorchRec's default slot
    evicted=[np.array([0, 1]), np.array([0])],
    test_ids=np.array([5, 2]),
    seconds=np.array([0.001, 0.003]),
  )
  return torchrec_managed.TorchRecFeed({"t": chosen}, {"t": CAPACITY}, {"t": 100}, seed=0)


def _batch(size):
  keys = np.arange(size, dtype=np.int64) + 10**12
  return {"t": mp.Keys(keys, np.arange(size), keys % CAPACITY)}


def test_torchrec_rows_are_looked_up_as_chosen():
  feed = _feed()
  rows = feed.train(_batch(4))
  assert rows["t"].numpy().tolist() == [1, 2, 0, 1]
  table = feed.layer.variables_by_table["t"]["parameters"]
  out = feed.layer(rows, remapped=True)["t"].numpy()
  np.testing.assert_array_equal(out, tf.gather(table, [1, 2, 0, 1]).numpy())
  assert (feed.hits, feed.lookups) == (3, 4) and feed.seconds == [0.001]
  assert feed.test(_batch(2))["t"].numpy().tolist() == [0, 3]


def test_evicted_rows_are_reset_before_the_step_that_reads_them():
  feed = _feed()
  feed.train(_batch(4))
  variables = feed.layer.variables_by_table["t"]
  fresh = {name: v.numpy().copy() for name, v in variables.items()}
  for v in variables.values():
    v.assign(tf.fill(v.shape, 7.0))
  rows = feed.train(_batch(3))  # TorchRec evicted its slot 0: our row 1
  assert rows["t"].numpy().tolist() == [3, 1, 2]
  parameters = variables["parameters"].numpy()
  assert not np.isclose(parameters[1], 7.0).any() and np.isclose(parameters[[0, 2, 3]], 7.0).all()
  for name, v in variables.items():
    if name != "parameters":  # optimizer slots: back to a fresh table's values
      np.testing.assert_array_equal(v.numpy()[1], fresh[name][1])


def _part(cell: str, ours: float, theirs: float) -> dict:
  runs = {
    "lfu compete": [ours],
    "TorchRec lfu, interval 2": [theirs],
    mp.HASHING: [0.4],
    mp.FULL: [0.2],
  }
  variants = {v: dict(metric=m, hit_rate=[0.5], remap_ms=[0.1]) for v, m in runs.items()}
  info = dict(versions={"torchrec": "1.8.0"}, threads=1)
  return dict(
    quality=dict(seeds=1, cells={cell: dict(variants=variants, torchrec=info)}), speed=None
  )


def test_cells_run_apart_are_reported_as_one(tmp_path):
  for folder, cell, ours in (("b", "time, 1/4", 0.25), ("a", "time, 1/8", 0.35)):
    (tmp_path / folder).mkdir()
    (tmp_path / folder / "results.json").write_text(json.dumps(_part(cell, ours, 0.3)))
  torchrec_managed.main(["--merge", "--out", str(tmp_path)])
  result = json.loads((tmp_path / "results.json").read_text())
  assert list(result["quality"]["cells"]) == ["time, 1/8", "time, 1/4"]  # in folder order
  cells = result["summary"]["cells"]
  assert cells["time, 1/4"]["ours_beating_it"] == ["lfu compete"]
  assert cells["time, 1/8"]["ours_beating_it"] == []
  text = (tmp_path / "RESULTS.md").read_text()
  assert "| lfu compete | 0.3500 (0.0000, 25%) | 0.2500 (0.0000, 75%) |" in text
  assert "Speed" not in text  # the parts were run with --no-speed
