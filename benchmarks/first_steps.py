"""Time to the first N training steps of the DLRM workload: `python -m benchmarks.first_steps`.

What a user waits for before training runs at speed: importing, building the model, tracing and
compiling the step (the first step), then the next N - 1 steps. Each implementation runs in its
own fresh process (tf-recommenders needs legacy Keras, set before TensorFlow is imported), on the
DLRM model and tables of `benchmarks.worker` (26 tables, 13 dense features). Prints one line per
(implementation, round) and the median of each figure.

  python -m benchmarks.first_steps [--steps 100] [--batch 256] [--rounds 3] [--small]

`--small` uses 26 tables of 1,000 rows (tracing dominates); the default uses the DLRM sizes of
`benchmarks.cases` (table creation counts too).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

IMPLS = ("ours", "tfrs")
FIGURES = ("import_s", "construct_s", "first_step_s", "next_steps_s", "total_s")


def child(impl: str, sizes: list[int], batch: int, steps: int) -> dict:
  """Runs in the measured process; `impl` decides the Keras version before TF is imported."""
  t_start = time.perf_counter()
  if impl == "tfrs":
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
  from benchmarks import worker  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_keras  # pylint: disable=g-import-not-at-top

  t_import = time.perf_counter() - t_start
  t0 = time.perf_counter()
  spec = {"impl": impl, "opt": "adagrad", "dim": 16, "sizes": sizes, "num_batches": 4}
  layer, optimizer = worker.build(spec)
  t_construct = time.perf_counter() - t0
  timings = worker.first_steps(
    tf,
    tf_keras,
    spec,
    layer,
    optimizer,
    {},
    sizes,
    {"multi_hot": list(worker.MULTI_HOT)},
    {"workload": "dlrm", "batch": batch},
    steps,
  )
  return {
    "impl": impl,
    "import_s": t_import,
    "construct_s": t_construct,
    **timings,
    "total_s": time.perf_counter() - t_start,
    "load_avg": os.getloadavg()[0],
  }


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.first_steps",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--rounds", type=int, default=1)
  parser.add_argument("--small", action="store_true")
  parser.add_argument("--child", choices=IMPLS, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.small:
    sizes = [1000] * 26
  else:
    from benchmarks import cases  # pylint: disable=g-import-not-at-top

    sizes = cases.dlrm_sizes()
  if args.child:
    print("RESULT " + json.dumps(child(args.child, sizes, args.batch, args.steps)), flush=True)
    return
  results = {impl: [] for impl in IMPLS}
  for _ in range(args.rounds):
    for impl in IMPLS:
      command = [
        sys.executable,
        "-m",
        "benchmarks.first_steps",
        "--child",
        impl,
        "--steps",
        str(args.steps),
        "--batch",
        str(args.batch),
      ]
      command += ["--small"] if args.small else []
      output = subprocess.run(
        command,
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
      ).stdout
      result = json.loads(output.split("RESULT ", 1)[1])
      results[impl].append(result)
      print(
        " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()),
        flush=True,
      )
  for impl, rows in results.items():
    print(
      f"median {impl}: "
      + ", ".join(
        f"{figure} {statistics.median(r[figure] for r in rows):.2f}" for figure in FIGURES
      )
    )


if __name__ == "__main__":
  main()
