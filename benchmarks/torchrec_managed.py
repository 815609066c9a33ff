"""`python -m benchmarks managed --torchrec [--seeds N] [--full] [--intervals 1,10]`: our managed
ids beside TorchRec's managed-collision module (`MCHManagedCollisionModule` with its LRU, LFU and
DistanceLFU eviction policies) on the same key streams.

Row choice: training the same model in both frameworks is out of scope, so the map is isolated.
TorchRec's module (in its own environment, benchmarks/torchrec_mch.py) steps through each stream
and says which row each key reads and which rows it evicted at each step; the same TF model as
benchmarks/managed_policies.py's then trains on those rows (TorchRec's default slot is our row 0,
slot i our row i + 1: `torchrec_mch.rows_of`), the evicted rows reset before the step that reads
them, as TorchRec's sharded module resets them (initial values, optimizer state). Beside it: our
policies (the layer's own remap), the hashing trick and the full vocabulary. Streams: MovieLens
100K's time-ordered split (the package's loader: a local ml-100k copy named by `MOVIELENS_DIR`,
else its synthetic stand-in) and the drifting stream, as in managed_policies.py. Per cell the
median over seeds and the spread (max - min) of the test RMSE or progressive log loss, and the
hit rate: the share of training lookups whose key held a row of its own.

TorchRec's module has no default eviction interval (a required argument); its adapter
(`torchrec.modules.mc_adapter`, sort ZCH) passes 1, its test models 2 and 1000: intervals 1 and 10
are run by default.

Speed: the remap per step on the same batches, a full map of `capacity` rows and Zipf(1.1) keys
over 10^8 (benchmarks/managed_ids.py's): ours `IdMap.remap` traced, theirs the module's forward
with `evict()`; median and mean per step (an interval > 1 evicts only every interval steps).

The default run (1/4 of the distinct keys, time split and drifting stream, 3 seeds) takes a few
minutes; `--full` adds 1/8 and 1/2 and the random split, 5 seeds, and a larger speed map.
Writes RESULTS.md and results.json under benchmarks/results/managed-torchrec[-full]/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import tensorflow as tf

import tpu_embedding
from benchmarks import managed_policies as mp
from benchmarks import torchrec_mch
from examples.data import drifting_ratings, movielens

HERE = os.path.dirname(os.path.abspath(__file__))
OURS = ("lfu compete", "lru", "lfu min_count=2", "distance_lfu compete")  # mp.POLICIES' names
DEFAULT = "lfu compete"  # what ManagedIds() is
# Cheap tunings of the default within the existing settings, run beside it (`--tunings`).
TUNINGS = {
  "lfu compete, half-life 50": dict(lfu_half_life_steps=50),
  "distance_lfu compete, decay 0.5": dict(eviction="distance_lfu", distance_decay=0.5),
}
SETTINGS = {**{name: mp.POLICIES[name] for name in OURS}, **TUNINGS}
DEFAULT_INTERVALS = (1, 10)


def torchrec_name(config: tuple[str, int]) -> str:
  return f"TorchRec {config[0]}, interval {config[1]}"


class RemapFeed(mp.Feed):
  """Our policy, its rows taken by the layer's `remap` (the call's own remap, made apart so that
  its rows and its time can be read), then the layer called with `remapped=True`."""

  remapped = True

  def __init__(self, variant: str, capacities: dict, full_sizes: dict, seed: int):
    self.variant = variant
    self.layer = mp.model_layer(capacities, tpu_embedding.ManagedIds(**SETTINGS[variant]), seed)
    self._remap = tf.function(self.layer.remap, reduce_retracing=True)
    self.hits, self.lookups, self.seconds = 0, 0, []

  def train(self, batch: dict) -> dict:
    keys = {name: tf.constant(k.keys) for name, k in batch.items()}
    start = time.perf_counter()
    rows = {name: r.numpy() for name, r in self._remap(keys).items()}
    self.seconds.append(time.perf_counter() - start)
    _count_hits(self, rows)
    return {name: tf.constant(r) for name, r in rows.items()}

  def test(self, batch: dict) -> dict:
    return self.layer.remap({name: tf.constant(k.keys) for name, k in batch.items()}, False)


class TorchRecFeed(mp.Feed):
  """The rows TorchRec's module chose ({table: `torchrec_mch.Chosen`}), in a managed table of
  as many rows whose own map never steps; the rows it evicted at a step are reset (`reset_rows`)
  before that step."""

  remapped = True

  def __init__(self, chosen: dict, capacities: dict, full_sizes: dict, seed: int):
    self.variant = "torchrec"
    self.layer = mp.model_layer(capacities, tpu_embedding.ManagedIds(), seed)
    self.chosen, self.capacities = chosen, capacities
    self._reset = tf.function(self.layer.reset_rows, reduce_retracing=True)
    self.step, self.hits, self.lookups = 0, 0, 0
    self.seconds = []

  def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
    return torchrec_mch.rows_of(ids, self.capacities[name])

  def train(self, batch: dict) -> dict:
    rows, resets = {}, {}
    for name, keys in batch.items():
      chosen = self.chosen[name]
      if len(chosen.ids[self.step]) != len(keys.keys):
        raise ValueError(f"TorchRec's rows for {name!r} do not match step {self.step}'s batch")
      rows[name] = self.rows(name, chosen.ids[self.step])
      resets[name] = tf.constant(self.rows(name, chosen.evicted[self.step]))
    if self.step == 0:  # the tables exist from the first call on
      self.layer({name: tf.zeros([1], tf.int64) for name in batch}, remapped=True)
    self._reset(resets)
    self.seconds.append(sum(float(self.chosen[name].seconds[self.step]) for name in batch))
    self.step += 1
    _count_hits(self, rows)
    return {name: tf.constant(r) for name, r in rows.items()}

  def test(self, batch: dict) -> dict:
    return {name: tf.constant(self.rows(name, self.chosen[name].test_ids)) for name in batch}


def _count_hits(feed, rows: dict) -> None:
  for r in rows.values():
    feed.hits += int(np.count_nonzero(r))
    feed.lookups += r.size


class Recorder:
  """A feed factory for managed_policies' runs that keeps the feed it made (its hits, times)."""

  def __init__(self, make):
    self.make, self.feed = make, None

  def __call__(self, variant, capacities, full_sizes, seed):
    self.feed = self.make(variant, capacities, full_sizes, seed)
    return self.feed


# ---------------------------------------------------------------------------------------------
# Quality


def movielens_streams(data, fraction: float, split: str, seed: int) -> dict:
  """{table: torchrec_mch.Stream}: the keys each training step of managed_policies.movielens_rmse
  looks up, and the test set's."""
  train, test, steps = mp.movielens_split(data, split, seed)
  capacities = mp.movielens_capacities(data, fraction)
  parts = {"users": (train.user_ids, test.user_ids), "movies": (train.movie_ids, test.movie_ids)}
  return {
    name: torchrec_mch.Stream(
      capacities[name], [mp._keys(ids[at]) for at in steps], mp._keys(test_ids)
    )
    for name, (ids, test_ids) in parts.items()
  }


def drift_streams(fraction: float, seed: int) -> dict:
  batches = [keys for _, keys, _, _ in drifting_ratings.rating_stream(**mp.DRIFT, seed=seed)]
  return {"items": torchrec_mch.Stream(mp.drift_capacity(fraction, mp.DRIFT), batches)}


def run_cell(evaluate, streams_of, seeds: int, configs: list, ours: tuple = OURS) -> dict:
  """One cell: every variant over the seeds. `evaluate(variant, seed, feed)` -> metric;
  `streams_of(seed)` -> the cell's key streams. Returns {variant: {"metric", "hit_rate",
  "remap_ms"}: each a list over seeds}."""
  streams = {(s, name): st for s in range(seeds) for name, st in streams_of(s).items()}
  chosen, info = torchrec_mch.remap(streams, configs)
  out = {}

  def record(variant, seed, make):
    recorder = Recorder(make)
    metric = evaluate(variant, seed, recorder)
    feed = recorder.feed
    cell = out.setdefault(variant, dict(metric=[], hit_rate=[], remap_ms=[]))
    cell["metric"].append(metric)
    cell["hit_rate"].append(feed.hits / feed.lookups if getattr(feed, "lookups", 0) else None)
    seconds = getattr(feed, "seconds", None)
    cell["remap_ms"].append(1000 * statistics.median(seconds) if seconds else None)

  for seed in range(seeds):
    for variant in ours:
      record(variant, seed, RemapFeed)
    for config in configs:
      by_table = {name: c[config] for (s, name), c in chosen.items() if s == seed}
      record(torchrec_name(config), seed, lambda v, c, f, s, t=by_table: TorchRecFeed(t, c, f, s))
    for variant in (mp.HASHING, mp.FULL):
      record(variant, seed, mp.Feed)
  return dict(variants=out, torchrec=info)


def run_quality(
  seeds: int, fractions, splits, configs, ours: tuple = OURS, drift: bool = True
) -> dict:
  data = movielens.load_movielens(data_dir=os.environ.get("MOVIELENS_DIR"))
  cells = {}
  for fraction in fractions:
    part = f"1/{round(1 / fraction)}"
    for split in splits:
      cells[f"MovieLens ({data.source}) {split}, {part}"] = run_cell(
        lambda variant, seed, feed, sp=split, fr=fraction: mp.movielens_rmse(
          variant, fr, sp, seed, data, feed
        ),
        lambda seed, sp=split, fr=fraction: movielens_streams(data, fr, sp, seed),
        seeds,
        configs,
        ours,
      )
    if not drift:
      continue
    cells[f"drifting stream, {part}"] = run_cell(
      lambda variant, seed, feed, fr=fraction: mp.drift_log_loss(variant, fr, seed, mp.DRIFT, feed),
      lambda seed, fr=fraction: drift_streams(fr, seed),
      seeds,
      configs,
      ours,
    )
  return dict(seeds=seeds, movielens_source=data.source, drift=mp.DRIFT, cells=cells)


# ---------------------------------------------------------------------------------------------
# Speed


def zipf_batches(capacity: int, batch: int, steps: int, seed: int = 0) -> list:
  """A batch of `capacity` distinct keys (the map full after it), then `steps` Zipf batches."""
  from benchmarks import managed_ids

  rng = np.random.default_rng(seed)
  fill = rng.choice(2**62, size=capacity, replace=False).astype(np.int64) + 2**62
  return [fill] + [managed_ids.zipf_keys(rng, batch)[0] for _ in range(steps)]


def our_remap_seconds(policy: str, capacity: int, batches: list) -> list:
  """Seconds of each traced `IdMap.remap` after the fill batch (given min_count times)."""
  from tpu_embedding.managed_ids import IdMap

  spec = tpu_embedding.ManagedIds(**mp.POLICIES[policy])
  id_map = IdMap(spec, "speed", capacity)
  remap = tf.function(
    lambda keys: id_map.remap(keys, True)[0], input_signature=[tf.TensorSpec([None], tf.int64)]
  )
  remap(tf.constant(np.repeat(batches[0], spec.min_count))).numpy()
  seconds = []
  for keys in batches[1:]:
    keys = tf.constant(keys)
    start = time.perf_counter()
    remap(keys).numpy()
    seconds.append(time.perf_counter() - start)
  return seconds


def run_speed(capacity: int, batch: int, steps: int, configs: list) -> dict:
  batches = zipf_batches(capacity, batch, steps)
  chosen, info = torchrec_mch.remap({"zipf": torchrec_mch.Stream(capacity, batches)}, configs)
  seconds = {policy: our_remap_seconds(policy, capacity, batches) for policy in OURS}
  for config in configs:
    seconds[torchrec_name(config)] = chosen["zipf"][config].seconds[1:].tolist()
  ms = {
    v: dict(median=1000 * statistics.median(s), mean=1000 * statistics.fmean(s), steps=len(s))
    for v, s in seconds.items()
  }
  return dict(capacity=capacity, batch=batch, steps=steps, ms=ms, torchrec=info)


# ---------------------------------------------------------------------------------------------
# Report


def summary(quality: dict) -> dict:
  """Per cell: medians and spreads of each metric, TorchRec's best variant, and which of our
  policies beat it."""
  cells = {}
  for cell, result in quality["cells"].items():
    stats = {}
    for variant, runs in result["variants"].items():
      stats[variant] = {}
      for key, values in runs.items():
        values = [v for v in values if v is not None]
        stats[variant][key] = (
          dict(median=statistics.median(values), spread=max(values) - min(values))
          if values
          else None
        )
    median = {v: s["metric"]["median"] for v, s in stats.items()}
    theirs = [v for v in median if v.startswith("TorchRec")]
    best = min(theirs, key=median.get)
    beats = [v for v in SETTINGS if v in median and median[v] < median[best]]
    cells[cell] = dict(stats=stats, torchrec_best=best, ours_beating_it=beats)
  everywhere = [v for v in SETTINGS if all(v in c["ours_beating_it"] for c in cells.values())]
  return dict(cells=cells, ours_beating_torchrec_best_everywhere=everywhere)


def _gap(stats: dict, variant: str) -> str:
  hashing, full = stats[mp.HASHING]["metric"]["median"], stats[mp.FULL]["metric"]["median"]
  return f"{100 * (hashing - stats[variant]['metric']['median']) / (hashing - full):.0f}%"


def _grid(table: dict, title: str, text) -> list:
  """A markdown table of variants by cells, `text(stats)` in each (rows all "–" left out)."""
  cells = list(table["cells"])
  lines = [
    "",
    title,
    "",
    "| variant | " + " | ".join(cells) + " |",
    "|" + "---|" * (len(cells) + 1),
  ]
  for v in next(iter(table["cells"].values()))["stats"]:
    row = [text(table["cells"][c]["stats"], v) for c in cells]
    if any(r != "–" for r in row):
      lines.append(f"| {v} | " + " | ".join(row) + " |")
  return lines


def _median(key: str, form: str):
  return lambda stats, v: "–" if stats[v][key] is None else format(stats[v][key]["median"], form)


def report(result: dict, table: dict) -> str:
  quality, speed = result["quality"], result["speed"]
  info = next(iter(quality["cells"].values()))["torchrec"]
  versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items())
  lines = [
    f"`{result.get('command', 'python -m benchmarks managed --torchrec')}`: our managed ids "
    f"beside TorchRec's MCHManagedCollisionModule ({versions}, {info['threads']} thread), the "
    "rows each chose fed to the same TF model. MovieLens (synthetic: the package's stand-in of "
    "the same shape; local: the real ml-100k, `MOVIELENS_DIR`): test RMSE after two epochs; "
    "drifting stream: progressive log loss; lower is better. A shared 2-core machine under "
    "other load.",
  ]
  lines += _grid(
    table,
    f"{quality['seeds']} seeds: median (spread max - min, share of the hashing-to-full-vocabulary "
    "gap closed):",
    lambda s, v: f"{s[v]['metric']['median']:.4f} ({s[v]['metric']['spread']:.4f}, {_gap(s, v)})",
  )
  lines += _grid(
    table,
    "Hit rate (training lookups whose key held a row of its own), median over seeds:",
    _median("hit_rate", ".3f"),
  )
  lines += _grid(
    table,
    "Remap per training step on these streams, ms (median over steps, median over seeds):",
    _median("remap_ms", ".2f"),
  )
  lines += [""] + [
    f"- {c}: TorchRec's best {t['torchrec_best']}; ours below it: "
    + (", ".join(t["ours_beating_it"]) or "none")
    + "."
    for c, t in table["cells"].items()
  ]
  everywhere = table["ours_beating_torchrec_best_everywhere"]
  lines.append(f"- Ours below TorchRec's best in every cell: {', '.join(everywhere) or 'none'}.")
  if speed is None:
    return "\n".join(lines)
  lines += [
    "",
    f"Speed: a full map of {speed['capacity']} rows, batches of {speed['batch']} Zipf(1.1) keys "
    f"over 10^8, {speed['steps']} steps after the fill; ms per step (same batches for all):",
    "",
    "| variant | median | mean |",
    "|---|---|---|",
  ]
  lines += [f"| {v} | {ms['median']:.2f} | {ms['mean']:.2f} |" for v, ms in speed["ms"].items()]
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks managed --torchrec")
  parser.add_argument("--seeds", type=int, default=None, help="default 3, with --full 5")
  parser.add_argument("--full", action="store_true")
  parser.add_argument("--intervals", default=",".join(map(str, DEFAULT_INTERVALS)))
  parser.add_argument("--fractions", default=None, help="table sizes, e.g. 8,4,2: 1/8, 1/4, 1/2")
  parser.add_argument("--splits", default=None, help="MovieLens splits, e.g. time,random")
  parser.add_argument("--tunings", action="store_true", help="also run TUNINGS of our default")
  parser.add_argument("--ours", default=None, help="our settings (names of SETTINGS, ;-separated)")
  parser.add_argument("--no-drift", action="store_true", help="MovieLens cells only")
  parser.add_argument("--no-speed", action="store_true", help="leave out the remap speed run")
  parser.add_argument("--merge", action="store_true", help="report --out's part folders as one")
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  if args.merge:
    merge(args.out, "python -m benchmarks managed --torchrec " + " ".join(argv or []))
    return
  if torchrec_mch.torchrec_python() is None:
    print(
      "Skipped: no TorchRec environment (run `make torchrec-env` or set "
      f"{torchrec_mch.ENVIRONMENT_VARIABLE} to its python)."
    )
    return
  intervals = [int(i) for i in args.intervals.split(",")]
  configs = [(policy, i) for policy in torchrec_mch.POLICIES for i in intervals]
  seeds = args.seeds or (5 if args.full else 3)
  fractions = mp.FRACTIONS if args.full else (1 / 4,)
  if args.fractions:
    fractions = tuple(1 / int(d) for d in args.fractions.split(","))
  splits = ("time", "random") if args.full else ("time",)
  splits = tuple(args.splits.split(",")) if args.splits else splits
  speed_rows, speed_steps = (2**18, 40) if args.full else (2**16, 30)
  ours = tuple(args.ours.split(";")) if args.ours else OURS + tuple(TUNINGS) * args.tunings
  unknown = [name for name in ours if name not in SETTINGS]
  if unknown:
    raise SystemExit(f"Unknown settings {unknown}; expected some of {list(SETTINGS)}.")
  result = dict(
    command="python -m benchmarks managed --torchrec " + " ".join(argv or []),
    quality=run_quality(seeds, fractions, splits, configs, ours, drift=not args.no_drift),
    speed=None if args.no_speed else run_speed(speed_rows, 8192, speed_steps, configs),
  )
  table = summary(result["quality"])
  name = "managed-torchrec" + ("-full" if args.full else "")
  out_dir = args.out or os.path.join(HERE, "results", name)
  mp.write(out_dir, report(result, table), dict(result, summary=table))


def merge(out_dir: str, command: str) -> None:
  """One report of the runs in `out_dir`'s subfolders (each a results.json of this script, run a
  cell at a time so that a long comparison keeps what it finished), cells in folder order."""
  quality, speed = None, None
  for name in sorted(os.listdir(out_dir)):
    path = os.path.join(out_dir, name, "results.json")
    if not os.path.exists(path):
      continue
    with open(path) as f:
      part = json.load(f)
    if quality is None:
      quality = dict(part["quality"], cells={})
    quality["cells"].update(part["quality"]["cells"])
    speed = speed or part["speed"]
  if quality is None:
    raise SystemExit(f"No results.json under {out_dir}'s subfolders.")
  result = dict(command=command, quality=quality, speed=speed)
  table = summary(quality)
  mp.write(out_dir, report(result, table), dict(result, summary=table))
