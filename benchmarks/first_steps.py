"""Time to the first N training steps, as a new user meets it: `python -m benchmarks.first_steps`.

What a user waits for before training runs at speed: importing, building the model, the first
step (tracing, optimizing and running the step function), then the next N - 1 steps. Every
measurement runs in its own fresh process, implementations alternating (A B A B ...) so that
load from other processes falls on both alike; the medians over rounds are printed side by side.

Cases (`--cases`, comma-separated):
  fit-partial         TF Model Garden's DLRM shape (`benchmarks.dlrm_keras`: 26 Criteo features,
                      vocabularies / 200, dim 16, batch 512, legacy Adagrad), `model.fit`,
                      `PartialTPUEmbedding` (size_threshold 50,000): ours against tfrs 0.7.7
  fit-tpu             the same with `TPUEmbedding`
  loop-partial        the same model in a custom training loop (`tf.function` + GradientTape)
  loop-tpu            ditto with `TPUEmbedding`
  keras3-fit-partial  Keras 3 `model.fit`: `tpu_embedding.keras.PartialTPUEmbedding` against
                      keras-rs 0.4.0 `DistributedEmbedding` (off TPU: Keras embeddings)
  keras3-fit-tpu      ditto with `tpu_embedding.keras.TPUEmbedding`
  dlrm-loop           the project's DLRM workload (`benchmarks.worker`, 26 tables, custom loop,
                      batch --batch): `TPUEmbedding` against tfrs; `--small` for 1,000 rows each

  python -m benchmarks.first_steps [--cases fit-partial,fit-tpu] [--steps 100] [--rounds 3]
                                   [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CASES = {  # case: (how it trains, embedding layer, Keras, (ours, the other implementation))
  "fit-partial": ("fit", "partial", "tf_keras", ("ours", "tfrs")),
  "fit-tpu": ("fit", "tpu", "tf_keras", ("ours", "tfrs")),
  "loop-partial": ("loop", "partial", "tf_keras", ("ours", "tfrs")),
  "loop-tpu": ("loop", "tpu", "tf_keras", ("ours", "tfrs")),
  "keras3-fit-partial": ("fit", "partial", "keras", ("ours-keras3", "keras-rs")),
  "keras3-fit-tpu": ("fit", "tpu", "keras", ("ours-keras3", "keras-rs")),
  "dlrm-loop": ("worker", "tpu", "tf_keras", ("ours", "tfrs")),
}
DEFAULT_CASES = "fit-partial,fit-tpu,loop-partial,loop-tpu,keras3-fit-partial,keras3-fit-tpu"
FIGURES = ("import_s", "construct_s", "first_step_s", "next_steps_s", "first_steps_s")
MODEL_GARDEN_BATCH = 512


def child(case: str, impl: str, steps: int, batch: int, small: bool) -> dict:
  """Runs in the measured process; `impl` decides the Keras version before TF is imported."""
  t_start = time.perf_counter()
  how, layer, keras_name, _ = CASES[case]
  if impl == "tfrs":
    os.environ["TF_USE_LEGACY_KERAS"] = "1"  # tfrs 0.7.7 imports only with legacy Keras
  import importlib

  import tensorflow as tf

  keras = importlib.import_module(keras_name)
  importlib.import_module(
    {"ours": "tpu_embedding", "ours-keras3": "tpu_embedding.keras", "keras-rs": "keras_rs"}.get(
      impl, "tensorflow_recommenders"
    )
  )
  t_import = time.perf_counter() - t_start
  if how == "worker":
    timings = _worker_steps(tf, keras, impl, steps, batch, small)
  else:
    timings = _model_garden_steps(tf, keras, impl, how, layer, steps)
  return {
    "case": case,
    "impl": impl,
    "import_s": t_import,
    **timings,
    "first_steps_s": timings["first_step_s"] + timings["next_steps_s"],
    "total_s": time.perf_counter() - t_start,
    "load_avg": os.getloadavg()[0],
  }


def _model_garden_steps(tf, keras, impl: str, how: str, layer: str, steps: int) -> dict:
  from benchmarks import dlrm_keras

  t0 = time.perf_counter()
  model, optimizer = dlrm_keras.build(impl, layer, tf, keras, MODEL_GARDEN_BATCH)
  data = dlrm_keras.dataset(tf, MODEL_GARDEN_BATCH)
  t_construct = time.perf_counter() - t0
  if how == "fit":
    marks = []

    class Marks(keras.callbacks.Callback):
      """The time at the start and at the end of each step (reading the loss waits for it)."""

      def on_train_begin(self, logs=None):
        marks.append(time.perf_counter())

      def on_train_batch_end(self, batch, logs=None):
        float(logs["loss"])
        marks.append(time.perf_counter())

    model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[Marks()])
  else:
    loss = keras.losses.BinaryCrossentropy(from_logits=True)
    step = dlrm_keras.custom_step(tf, model, optimizer, loss)
    iterator = iter(data)
    marks = [time.perf_counter()]
    float(step(*next(iterator)))
    marks.append(time.perf_counter())
    for _ in range(steps - 1):
      value = step(*next(iterator))
    float(value)
    marks.append(time.perf_counter())
  return {
    "construct_s": t_construct,
    "first_step_s": marks[1] - marks[0],
    "next_steps_s": marks[-1] - marks[1],
  }


def _worker_steps(tf, tf_keras, impl: str, steps: int, batch: int, small: bool) -> dict:
  from benchmarks import cases, worker

  sizes = [1000] * 26 if small else cases.dlrm_sizes()
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
  return {"construct_s": t_construct, **timings}


def _run_child(case: str, impl: str, args: argparse.Namespace) -> dict:
  command = [sys.executable, "-m", "benchmarks.first_steps", "--child", f"{case}:{impl}"]
  command += ["--steps", str(args.steps), "--batch", str(args.batch)]
  command += ["--small"] if args.small else []
  output = subprocess.run(
    command,
    capture_output=True,
    text=True,
    check=True,
    env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
  ).stdout
  return json.loads(output.split("RESULT ", 1)[1])


def summarize(results: list[dict]) -> list[dict]:
  """Per case: each implementation's median figures and ours / the other's ratio."""
  rows = []
  for case in dict.fromkeys(r["case"] for r in results):
    ours, other = CASES[case][3]
    medians = {}
    for impl in (ours, other):
      runs = [r for r in results if r["case"] == case and r["impl"] == impl]
      medians[impl] = {f: statistics.median(r[f] for r in runs) for f in FIGURES}
    rows.append(
      {
        "case": case,
        "ours": ours,
        "other": other,
        "rounds": len(runs),
        "medians": medians,
        "ratio": {f: medians[ours][f] / medians[other][f] for f in FIGURES},
      }
    )
  return rows


def markdown(rows: list[dict], steps: int, load: str) -> str:
  lines = [
    f"Medians over fresh processes, seconds; first {steps} steps = first step + the next "
    f"{steps - 1}; ratio = ours / the other. Load while measuring: {load}.",
    "",
    "| case | implementation | import | construct | first step | next steps | first steps |",
    "|---|---|---:|---:|---:|---:|---:|",
  ]
  for row in rows:
    for impl in (row["ours"], row["other"]):
      m = row["medians"][impl]
      lines.append(
        f"| {row['case']} | {impl} | " + " | ".join(f"{m[f]:.2f}" for f in FIGURES) + " |"
      )
    r = row["ratio"]
    lines.append(f"| {row['case']} | ratio | " + " | ".join(f"{r[f]:.2f}x" for f in FIGURES) + " |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.first_steps",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("--cases", default=DEFAULT_CASES)
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--batch", type=int, default=256, help="dlrm-loop only")
  parser.add_argument("--rounds", type=int, default=1)
  parser.add_argument("--small", action="store_true", help="dlrm-loop only")
  parser.add_argument("--out", help="write first_steps.{json,md} into this folder")
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    case, impl = args.child.split(":")
    result = child(case, impl, args.steps, args.batch, args.small)
    print("RESULT " + json.dumps(result), flush=True)
    return
  cases = args.cases.split(",")
  unknown = sorted(set(cases) - set(CASES))
  if unknown:
    parser.error(f"unknown cases {unknown}; known: {sorted(CASES)}")
  results = []
  for _ in range(args.rounds):
    for case in cases:
      for impl in CASES[case][3]:
        result = _run_child(case, impl, args)
        results.append(result)
        print(
          " ".join(
            f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()
          ),
          flush=True,
        )
  rows = summarize(results)
  table = markdown(rows, args.steps, load_line(results))
  print(table)
  if args.out:
    save(args.out, "first_steps", {"runs": results, "summary": rows, "steps": args.steps}, table)


def load_line(results: list[dict]) -> str:
  """The machine's load over the runs, for the record beside their figures."""
  loads = [r["load_avg"] for r in results]
  return f"1-minute load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores"


def save(out: str, name: str, record: dict, table: str) -> None:
  """`record` as `<out>/<name>.json` and the printed `table` as `<out>/<name>.md`."""
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, f"{name}.json"), "w", encoding="utf-8") as f:
    json.dump(record, f, indent=1)
  with open(os.path.join(out, f"{name}.md"), "w", encoding="utf-8") as f:
    f.write(table)


if __name__ == "__main__":
  main()
