"""`python -m benchmarks managed --sweep [--seeds 3] [--settings "A;B"] [--part NAME]
[--splits time,random]`: settings of `ManagedIds` screened beside TorchRec's best (issue 45: a
default that beats TorchRec's managed-collision module on every cell).

Each setting in SETTINGS runs through managed_policies' cells: the drifting stream and the
MovieLens stand-in's time and random splits (`--splits`: others of managed_policies.SPLITS,
e.g. user_time), at tables of 1/8, 1/4 and 1/2 of the distinct keys; one JSON line per (cell,
setting, seed) is appended to runs-<part>.jsonl under benchmarks/results/managed-sweep/ (parts
let two processes share the work).
`--torchrec-random` runs TorchRec's module (intervals 1 and 10) on the random split, which the
committed TorchRec run (managed-torchrec-full, `--splits time`) did not measure, into
torchrec-random.json; `--prototypes` runs benchmarks/managed_prototypes.py's scores (not the
package's) alike; `--report` writes RESULTS.md from what is there: per cell each setting's
median over seeds and its paired median difference from TorchRec's best variant of the cell
(the same seeds: each seed's stream is the same for every variant), TorchRec's numbers taken
from managed-torchrec-full/results.json (time split, drifting stream) and torchrec-random.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Optional

import numpy as np

import tpu_embedding
from benchmarks import managed_policies as mp

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results", "managed-sweep")
TORCHREC_FULL = os.path.join(HERE, "results", "managed-torchrec-full", "results.json")
KINDS = ("drift", "time", "random")  # the default run's; mp.SPLITS' "user_time" when asked


def cells_of(kinds: tuple = KINDS) -> list:
  return [(kind, part) for part in (8, 4, 2) for kind in kinds]


CELLS = cells_of()
LFU, DLFU = dict(eviction="lfu", admission="compete"), dict(eviction="distance_lfu")
SETTINGS = {
  "lfu compete (default)": LFU,
  "lfu compete, min_count=2": dict(LFU, min_count=2),
  "lfu compete, min_count=3": dict(LFU, min_count=3),
  "lfu compete, half-life 10^5": dict(LFU, lfu_half_life_steps=100_000),
  "lfu compete, half-life 300": dict(LFU, lfu_half_life_steps=300),
  "lfu compete, half-life 100": dict(LFU, lfu_half_life_steps=100),
  "lfu compete, half-life 20": dict(LFU, lfu_half_life_steps=20),
  "lfu compete, half-life 10": dict(LFU, lfu_half_life_steps=10),
  "lfu compete, half-life 5": dict(LFU, lfu_half_life_steps=5),
  "lfu compete, half-life 2": dict(LFU, lfu_half_life_steps=2),
  "distance_lfu compete, decay 0.5": dict(DLFU, distance_decay=0.5),
  "distance_lfu compete, decay 1": DLFU,
  "distance_lfu compete, decay 1.5": dict(DLFU, distance_decay=1.5),
  "distance_lfu compete, decay 2": dict(DLFU, distance_decay=2.0),
  "distance_lfu compete, min_count=2": dict(DLFU, min_count=2),
  "distance_lfu always": dict(DLFU, admission="always"),
  "lru": dict(eviction="lru"),
}


class SweepFeed(mp.Feed):
  """A managed layer of one of SETTINGS (the layer's call remaps the raw keys)."""

  def __init__(self, variant: str, capacities: dict, full_sizes: dict, seed: int):
    self.variant = variant
    self.layer = mp.model_layer(capacities, tpu_embedding.ManagedIds(**SETTINGS[variant]), seed)


def cell_name(kind: str, part: int) -> str:
  return f"{'drifting stream' if kind == 'drift' else f'MovieLens {kind}'}, 1/{part}"


def run(settings: list, seeds: range, path: str, feed=SweepFeed, cells: list = CELLS) -> None:
  from examples.data import movielens

  data = movielens.load_movielens(data_dir=os.environ.get("MOVIELENS_DIR"))
  for kind, part in cells:
    for variant in settings:
      for seed in seeds:
        start = time.perf_counter()
        if kind == "drift":
          metric = mp.drift_log_loss(variant, 1 / part, seed, mp.DRIFT, feed)
        else:
          metric = mp.movielens_rmse(variant, 1 / part, kind, seed, data, feed)
        line = dict(cell=cell_name(kind, part), variant=variant, seed=seed, metric=metric)
        line["movielens"] = data.source
        with open(path, "a") as f:
          f.write(json.dumps(dict(line, seconds=time.perf_counter() - start)) + "\n")


def run_torchrec_random(seeds: int, path: str) -> None:
  """TorchRec's module (every policy, intervals 1 and 10) and our default on the random split."""
  from benchmarks import torchrec_managed as tm
  from benchmarks import torchrec_mch
  from examples.data import movielens

  data = movielens.load_movielens(data_dir=os.environ.get("MOVIELENS_DIR"))
  configs = [(policy, i) for policy in torchrec_mch.POLICIES for i in tm.DEFAULT_INTERVALS]
  cells = {}
  for part in (8, 4, 2):
    cells[cell_name("random", part)] = tm.run_cell(
      lambda v, s, feed, p=part: mp.movielens_rmse(v, 1 / p, "random", s, data, feed),
      lambda s, p=part: tm.movielens_streams(data, 1 / p, "random", s),
      seeds,
      configs,
      (tm.DEFAULT,),
    )
  with open(path, "w") as f:
    json.dump(dict(seeds=seeds, source=data.source, cells=cells), f, indent=1)


def torchrec_runs(out: str = OUT, sources: Optional[list] = None) -> dict:
  """{cell: {variant: [metric per seed]}} of TorchRec's variants, the hashing trick and the full
  vocabulary, from TorchRec runs: `sources`, [(results.json, key of the cells' dict or None)],
  by default the committed runs on the stand-in."""
  runs = {}
  sources = sources or [
    (TORCHREC_FULL, "quality"),
    (os.path.join(out, "torchrec-random.json"), None),
  ]
  for path, key in sources:
    if not os.path.exists(path):
      continue
    with open(path) as f:
      result = json.load(f)
    for cell, value in (result[key] if key else result)["cells"].items():
      name = cell.replace(" (synthetic)", "").replace(" (local)", "")
      runs[name] = {
        v: r["metric"]
        for v, r in value["variants"].items()
        if v.startswith("TorchRec") or v in (mp.HASHING, mp.FULL)
      }
  return runs


def summary(ours: dict, theirs: dict) -> dict:
  """Per cell and setting: median, TorchRec's best (by median over the same seeds), the paired
  median difference from it, on how many seeds ours was lower, and (where the cell's hashing
  trick and full vocabulary were run, the full vocabulary the lower) that difference as a share
  of the hashing-to-full gap."""
  cells = {}
  for cell, by_variant in ours.items():
    out = {}
    for variant, by_seed in by_variant.items():
      seeds = sorted(by_seed)
      entry = dict(median=statistics.median(by_seed.values()), seeds=len(seeds))
      if cell in theirs:
        medians = {v: statistics.median(r[s] for s in seeds) for v, r in theirs[cell].items()}
        best = min((v for v in medians if v.startswith("TorchRec")), key=medians.get)
        diffs = [by_seed[s] - theirs[cell][best][s] for s in seeds]
        entry.update(
          torchrec_best=best,
          torchrec_median=medians[best],
          paired_median_difference=statistics.median(diffs),
          seeds_lower=int(np.sum(np.array(diffs) < 0)),
        )
        gap = medians.get(mp.HASHING, 0.0) - medians.get(mp.FULL, 0.0)
        if gap > 0:  # a share of no gap, or of one the wrong way, says nothing
          entry["share_of_gap"] = entry["paired_median_difference"] / gap
      out[variant] = entry
    cells[cell] = out
  return cells


def load_runs(out: str = OUT) -> dict:
  ours = {}
  for name in sorted(os.listdir(out)) if os.path.isdir(out) else []:
    if name.startswith("runs-") and name.endswith(".jsonl"):
      with open(os.path.join(out, name)) as f:
        for line in f:
          r = json.loads(line)
          ours.setdefault(r["cell"], {}).setdefault(r["variant"], {})[r["seed"]] = r["metric"]
  return ours


def report(command: str, out: str = OUT, torchrec_results: Optional[str] = None) -> str:
  """RESULTS.md's text for the runs in `out`, paired with TorchRec's: the committed runs on the
  stand-in, or `torchrec_results` (results.json files of benchmarks/torchrec_managed.py,
  separated by ;)."""
  ours = load_runs(out)
  paths = [] if torchrec_results is None else torchrec_results.split(";")
  sources = [(path, "quality") for path in paths] or None
  cells = summary(ours, torchrec_runs(out, sources))
  names = [cell_name(k, p) for k, p in cells_of(("drift",) + mp.SPLITS) if cell_name(k, p) in cells]
  others = [c for c in cells if c not in names]  # "-seen" splits' cells, by size
  names += sorted(others, key=lambda c: (-int(c.rsplit("/", 1)[1]), c))
  variants = list(dict.fromkeys(v for c in names for v in cells[c]))
  variants.sort(key=lambda v: list(SETTINGS).index(v) if v in SETTINGS else len(SETTINGS))
  if torchrec_results is None:
    data = "MovieLens: the package's synthetic stand-in"
    theirs = (
      "managed-torchrec-full/results.json (time split, drifting stream) and torchrec-random.json "
      "(`python -m benchmarks managed --sweep --torchrec-random --seeds 5`)"
    )
    intervals = "1 and 10"
  else:
    data = "MovieLens: the real MovieLens 100K (`MOVIELENS_DIR`; `make movielens`)"
    theirs = " and ".join(os.path.relpath(path, os.path.dirname(out)) for path in paths)
    intervals = "1, 2 and 10"
  lines = [
    f"`{command}`: settings of `ManagedIds` beside TorchRec's best variant of each cell "
    f"(MCHManagedCollisionModule, LRU/LFU/DistanceLFU at eviction intervals {intervals}). "
    f"{data} (test RMSE after two epochs); drifting "
    "stream: progressive log loss; lower is better. Each entry: median over seeds, then the "
    "paired median difference from TorchRec's best (negative: ours lower) and on how many "
    "seeds ours was lower (of 3 or 5: a setting of 3 seeds pairs with TorchRec's runs of those "
    "seeds, so its TorchRec's best may differ slightly from the row below, the first setting's). "
    "Ours: runs-*.jsonl (`python -m benchmarks managed --sweep --seeds 3 --settings ... --part "
    "...`, seeds 3-4 added with `--seeds 5 --first-seed 3`, the prototypes with `--prototypes`); "
    f"TorchRec's: {theirs}.",
    "",
    "| setting | " + " | ".join(names) + " |",
    "|" + "---|" * (len(names) + 1),
  ]
  best_row = []
  for c in names:
    entry = next((e for e in cells[c].values() if "torchrec_best" in e), None)
    best_row.append(
      "–" if entry is None else f"{entry['torchrec_median']:.4f} ({entry['torchrec_best']})"
    )
  lines.append("| TorchRec's best | " + " | ".join(best_row) + " |")
  for v in variants:
    row = []
    for c in names:
      e = cells[c].get(v)
      if e is None:
        row.append("–")
      elif "paired_median_difference" in e:
        row.append(
          f"{e['median']:.4f} ({e['paired_median_difference']:+.4f}, "
          f"{e['seeds_lower']}/{e['seeds']})"
        )
      else:
        row.append(f"{e['median']:.4f}")
    lines.append(f"| {v} | " + " | ".join(row) + " |")
  winners = [
    v
    for v in variants
    if all(v in cells[c] and cells[c][v].get("paired_median_difference", 1.0) <= 0 for c in names)
  ]
  everywhere = ", ".join(winners) or "none"
  lines += ["", f"Settings at or below TorchRec's best in every cell: {everywhere}.", ""]
  lines.append(
    "Each setting's worst cell: its paired difference from TorchRec's best as a share of that "
    "cell's hashing-to-full-vocabulary gap (positive: behind TorchRec; cells where the full "
    "vocabulary is not below the hashing trick left out):"
  )
  lines.append("")
  for v in variants:
    shares = {
      c: cells[c][v]["share_of_gap"] for c in names if "share_of_gap" in cells[c].get(v, {})
    }
    if shares:
      worst = max(shares, key=shares.get)
      lines.append(f"- {v}: {100 * shares[worst]:+.1f}% ({worst})")
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(dict(command=command, cells=cells, winners=winners), f, indent=1)
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks managed --sweep")
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--first-seed", type=int, default=0, help="run seeds first-seed..seeds-1")
  parser.add_argument("--settings", default=None, help="names of SETTINGS, separated by ;")
  parser.add_argument("--part", default="0", help="runs-<part>.jsonl")
  parser.add_argument("--torchrec-random", action="store_true")
  parser.add_argument("--prototypes", action="store_true", help="benchmarks/managed_prototypes.py")
  parser.add_argument("--report", action="store_true")
  parser.add_argument("--out", default=OUT, help="the folder of the runs and the report")
  parser.add_argument("--movielens-only", action="store_true", help="leave out the drift cells")
  parser.add_argument(
    "--splits", default=None, help="only these MovieLens splits, e.g. user_time,time-seen (see "
    "managed_policies.movielens_split)"
  )  # fmt: skip
  parser.add_argument(
    "--torchrec-results", default=None, help="TorchRec's runs to pair with (a results.json of "
    "`managed --torchrec`); by default the committed runs on the stand-in"
  )  # fmt: skip
  args = parser.parse_args(argv)
  out = args.out
  os.makedirs(out, exist_ok=True)
  if args.report:
    text = report(
      "python -m benchmarks managed --sweep " + " ".join(argv or []), out, args.torchrec_results
    )
    with open(os.path.join(out, "RESULTS.md"), "w") as f:
      f.write(text + "\n")
    print(text)
  elif args.torchrec_random:
    run_torchrec_random(args.seeds, os.path.join(out, "torchrec-random.json"))
  else:
    feed, known, runs = SweepFeed, SETTINGS, f"runs-{args.part}.jsonl"
    if args.prototypes:
      from benchmarks import managed_prototypes as mpr

      feed, known, runs = mpr.PrototypeFeed, mpr.PROTOTYPES, f"runs-prototypes-{args.part}.jsonl"
    settings = args.settings.split(";") if args.settings else list(known)
    unknown = [s for s in settings if s not in known]
    if unknown:
      raise SystemExit(f"Unknown settings {unknown}; expected some of {list(known)}.")
    kinds = ("drift",) + tuple(args.splits.split(",")) if args.splits else KINDS
    cells = [c for c in cells_of(kinds) if not (args.movielens_only and c[0] == "drift")]
    run(settings, range(args.first_seed, args.seeds), os.path.join(out, runs), feed, cells)
