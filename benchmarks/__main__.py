"""`python -m benchmarks all [--quick]` or `python -m benchmarks <case> [<case> ...] [--quick]`.

`python -m benchmarks managed [--quick] [--speed-only]` runs the managed-ids benchmark
(benchmarks/managed_ids.py) on its own; `python -m benchmarks managed --quality [--seeds N]
[--out NAME] [--movielens-only] [--splits time,random]` compares its policies
(benchmarks/managed_policies.py); `python -m benchmarks managed --torchrec [--seeds N] [--full]
[--intervals 1,10]` puts them beside TorchRec's managed-collision module
(benchmarks/torchrec_managed.py; needs `make torchrec-env`); `python -m benchmarks managed
--sweep` screens settings beside TorchRec's best (benchmarks/managed_sweep.py); `python -m
benchmarks preflight [--quick] [--data_dir ml-100k]` the SparseCore pre-flight's
(benchmarks/preflight.py).

`python -m benchmarks serving --large [--quick]` runs the serving benchmark's large-table case
(benchmarks/serving_latency.py --large: tables of 4M and 2M rows, about 4 minutes) on its own and
writes benchmarks/results/serving_latency_large.{md,json,png}; `--case wide` the same bytes in
rows of dim 128 (serving_latency_wide.*).

`python -m benchmarks model_garden [--rounds 3] [--out DIR]` runs TF Model Garden's ranking
trainer with tfrs's layers and with ours (benchmarks/model_garden.py; needs the client set up
outside this repository, and says how when it is missing).

Prints markdown tables and writes RESULTS.md, results.json and PNG plots to
benchmarks/results/ (full run of all cases), benchmarks/results/quick/ (--quick) or
benchmarks/results/<cases>[-quick]/ (single cases), unless --out is given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from benchmarks import cases as cases_lib
from benchmarks import report as report_lib

HERE = os.path.dirname(os.path.abspath(__file__))


def _stand_alone(argv: list) -> bool:
  """Runs a benchmark that writes its own results (serving --large, model_garden); False when
  `argv` asks for none."""
  if argv[:1] == ["serving"] and ("--large" in argv or "--case" in argv):
    import subprocess

    script = os.path.join(HERE, "serving_latency.py")
    subprocess.run([sys.executable, script, *argv[1:]], check=True)
    return True
  if argv[:1] == ["model_garden"]:
    from benchmarks import model_garden

    model_garden.main(argv[1:])
    return True
  return False


def _managed(argv: list) -> None:
  """`python -m benchmarks managed ...`: the managed-ids benchmarks."""
  if "--sweep" in argv:
    from benchmarks import managed_sweep

    managed_sweep.main([a for a in argv[1:] if a != "--sweep"])
    return
  if "--torchrec" in argv:
    from benchmarks import torchrec_managed

    torchrec_managed.main([a for a in argv[1:] if a != "--torchrec"])
    return
  if "--quality" in argv:
    from benchmarks import managed_policies

    seeds = argv[argv.index("--seeds") + 1] if "--seeds" in argv else "5"
    name = argv[argv.index("--out") + 1] if "--out" in argv else "managed-quality"
    splits = argv[argv.index("--splits") + 1] if "--splits" in argv else "time,random"
    managed_policies.main(
      int(seeds), name, "--movielens-only" not in argv, tuple(splits.split(","))
    )
    return
  from benchmarks import managed_ids

  quick = "--quick" in argv
  speed_only = "--speed-only" in argv
  name = "managed" + ("-quick" if quick else "") + ("-speed" if speed_only else "")
  managed_ids.main(quick, os.path.join(HERE, "results", name), speed_only=speed_only)


def main(argv=None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["managed"]:
    _managed(argv)
    return
  if argv[:1] == ["preflight"]:
    from benchmarks import preflight

    quick = "--quick" in argv
    data_dir = argv[argv.index("--data_dir") + 1] if "--data_dir" in argv else None
    name = "preflight" + ("-quick" if quick else "")
    preflight.main(quick, os.path.join(HERE, "results", name), data_dir)
    return
  if _stand_alone(argv):
    return
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("cases", nargs="+", choices=("all",) + cases_lib.CASES)
  parser.add_argument(
    "--quick", action="store_true", help="fewer repetitions, steps, sizes and batches (< 5 minutes)"
  )
  parser.add_argument(
    "--rounds", type=int, default=None, help="fresh processes per implementation (default 1)"
  )
  parser.add_argument("--out", default=None)
  parser.add_argument(
    "--report-only",
    metavar="RESULTS_JSON",
    default=None,
    help="rebuild RESULTS.md and the plots from a results.json; run nothing",
  )
  args = parser.parse_args(argv)
  selected = set(cases_lib.CASES) if "all" in args.cases else set(args.cases)
  settings = cases_lib.Settings.make(args.quick)
  if args.rounds:
    settings.rounds = args.rounds
  if args.out:
    out_dir = args.out
  elif "all" in args.cases:
    out_dir = (
      os.path.join(HERE, "results", "quick") if args.quick else os.path.join(HERE, "results")
    )
  else:
    out_dir = os.path.join(
      HERE, "results", "-".join(sorted(selected)) + ("-quick" if args.quick else "")
    )
  os.makedirs(out_dir, exist_ok=True)
  command = "python -m benchmarks " + " ".join(args.cases) + (" --quick" if args.quick else "")
  if args.rounds:
    command += f" --rounds {args.rounds}"
  if args.report_only:
    with open(args.report_only, encoding="utf-8") as f:
      raw = json.load(f)
    settings = cases_lib.Settings(**raw["settings"])
  else:
    raw = cases_lib.run(selected, settings, out_dir)
    with open(os.path.join(out_dir, "results.json"), "w", encoding="utf-8") as f:
      json.dump(raw, f, indent=1)
  report = report_lib.Report(raw, settings, out_dir, command).build()
  with open(os.path.join(out_dir, "RESULTS.md"), "w", encoding="utf-8") as f:
    f.write(report)
  print(report)
  print(f"Wrote {os.path.join(out_dir, 'RESULTS.md')}", file=sys.stderr)


if __name__ == "__main__":
  main()
