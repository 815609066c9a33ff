"""Start-up in TF Model Garden's own ranking trainer: `python -m benchmarks model_garden`.

The real client, unchanged: `official/recommendation/ranking/train.py` of tf-models-official
2.20.0 (its `main`, its `RankingTask`, tfrs's `Ranking` model with its metrics and
`CompositeOptimizer`), DLRM with `PartialTPUEmbedding` (size_threshold 50,000), batch 512, the 26
Criteo features with vocabularies divided by 200, synthetic data. The only change for "ours" is
the layer classes the trainer's task module reads from tfrs (`tfrs.experimental.layers.embedding.
PartialTPUEmbedding`, `tfrs.layers.embedding.tpu_embedding_layer.TPUEmbedding`), which become
this package's. Both loops the trainer has run: `model.fit` (`use_orbit: false`) and Orbit's.

Each run is a fresh process, tfrs and ours alternating. A thread reads the step counter (the
model optimizer's `iterations`) every 2 ms and notes when it reaches step 1, 100 and the last;
reported: seconds from the process's start to step 1 and to step 100, seconds from the model's
construction to step 100 (the first 100 steps: tracing included), and examples/s after step 100.

The client lives outside this repository (`MODEL_GARDEN_DIR`, default below); when it is
missing the benchmark prints how to set it up.

  python -m benchmarks model_garden [--rounds 3] [--steps 300] [--loops fit,orbit]
                                    [--layer partial|tpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks import dlrm_keras, first_steps
from benchmarks import harness as h

DEFAULT_CLIENT = "/work/envs/model_garden"
CLIENT_VERSION = "2.20.0"
# What train.py imports beyond this project's environment (tensorboard: its summaries).
CLIENT_DEPENDENCIES = ("gin-config", "pyyaml", "tensorboard")
IMPLS = ("tfrs", "ours")
LOOPS = ("fit", "orbit")
BATCH = 512
STEPS_PER_LOOP = 100  # Orbit's inner loop and fit's steps_per_execution (the same config key)
MARK = 100  # the step start-up is measured to
POLL_S = 0.002
FIGURES = ("to_step_1_s", "to_step_100_s", "first_100_steps_s", "steady_examples_per_s")


def client_dir() -> str:
  return os.environ.get("MODEL_GARDEN_DIR", DEFAULT_CLIENT)


def setup_instructions(folder: str) -> str:
  pip = f"{sys.executable} -m pip"
  return "\n".join(
    [
      f"TF Model Garden's trainer was not found under {folder} (src/official/recommendation/"
      "ranking/train.py). Set it up there (the project's environment stays untouched):",
      f"  mkdir -p {folder} && cd {folder}",
      f"  {pip} download tf-models-official=={CLIENT_VERSION} --no-deps -d .",
      f"  {sys.executable} -m zipfile -e tf_models_official-{CLIENT_VERSION}-py2.py3-none-any.whl"
      " src",
      f"  {pip} install --no-deps --target site " + " ".join(CLIENT_DEPENDENCIES),
      "or point MODEL_GARDEN_DIR at a folder laid out so.",
    ]
  )


def params_override(loop: str, layer: str, steps: int) -> dict:
  """The trainer's configuration beyond its `dlrm_criteo` experiment: the model of
  `benchmarks.dlrm_keras` (dim 16, MLPs 512-256-16 and 512-256-1), synthetic data, the loop, and
  no evaluation, profiling or intermediate checkpoint in the measured steps."""
  return {
    "task": {
      "use_synthetic_data": True,
      "model": {
        "vocab_sizes": dlrm_keras.vocabularies(),
        "use_partial_tpu_embedding": layer == "partial",
        "size_threshold": dlrm_keras.SIZE_THRESHOLD,
        "embedding_dim": dlrm_keras.DIM,
        "bottom_mlp": [512, 256, dlrm_keras.DIM],
        "top_mlp": [512, 256, 1],
      },
      "train_data": {"global_batch_size": BATCH},
      "validation_data": {"global_batch_size": BATCH},
    },
    "trainer": {
      "use_orbit": loop == "orbit",
      "train_steps": steps,
      "validation_interval": steps,
      "steps_per_loop": STEPS_PER_LOOP,
      "summary_interval": STEPS_PER_LOOP,
      "checkpoint_interval": steps,
    },
  }


class StepClock:
  """Notes the wall time at which a step counter first reads >= each mark, from a thread."""

  def __init__(self, marks: tuple[int, ...]):
    self.marks = marks
    self.times: dict[int, float] = {}
    self.built_at = None

  def watch(self, counter) -> None:
    self.built_at = time.time()
    threading.Thread(target=self._poll, args=(counter,), daemon=True).start()

  def _poll(self, counter) -> None:
    while len(self.times) < len(self.marks):
      step = int(counter.numpy())
      now = time.time()
      for mark in self.marks:
        if step >= mark and mark not in self.times:
          self.times[mark] = now
      time.sleep(POLL_S)


def child(impl: str, loop: str, layer: str, steps: int, started_at: float) -> dict:
  """Runs the trainer's main in this (fresh) process; the timings relative to `started_at`."""
  os.environ["TF_USE_LEGACY_KERAS"] = "1"  # tfrs 0.7.7, whose Ranking model the trainer builds
  folder = client_dir()
  sys.path[:0] = [os.path.join(folder, "src"), os.path.join(folder, "site")]
  from absl import flags
  from official.recommendation.ranking import common, train
  from official.recommendation.ranking import task as task_lib

  if impl == "ours":
    import tpu_embedding

    tfrs = task_lib.tfrs
    tfrs.experimental.layers.embedding.PartialTPUEmbedding = tpu_embedding.PartialTPUEmbedding
    tfrs.layers.embedding.tpu_embedding_layer.TPUEmbedding = tpu_embedding.TPUEmbedding

  clock = StepClock((1, MARK, steps))
  build_model = task_lib.RankingTask.build_model

  def build_and_watch(task):
    model = build_model(task)
    clock.watch(model.optimizer.iterations)  # created here, under the trainer's strategy
    return model

  task_lib.RankingTask.build_model = build_and_watch
  model_dir = tempfile.mkdtemp(prefix="model_garden_")
  common.define_flags()
  flags.FLAGS(
    [
      "train",
      "--experiment=dlrm_criteo",
      "--mode=train",
      f"--model_dir={model_dir}",
      "--profile_steps=0,0",  # fit's TensorBoard callback would profile steps 20-40
      "--params_override=" + json.dumps(params_override(loop, layer, steps)),
    ]
  )
  try:
    train.main(None)
  finally:
    shutil.rmtree(model_dir, ignore_errors=True)
  t = clock.times
  return {
    "impl": impl,
    "loop": loop,
    "to_step_1_s": t[1] - started_at,
    "to_step_100_s": t[MARK] - started_at,
    "first_100_steps_s": t[MARK] - clock.built_at,
    "steady_examples_per_s": BATCH * (steps - MARK) / (t[steps] - t[MARK]),
    "load_avg": os.getloadavg()[0],
  }


def run_child(impl: str, loop: str, args: argparse.Namespace) -> dict:
  command = [sys.executable, "-m", "benchmarks.model_garden", "--child", f"{impl}:{loop}"]
  command += ["--steps", str(args.steps), "--layer", args.layer, "--started-at", str(time.time())]
  proc = subprocess.run(
    command,
    cwd=h.REPO_ROOT,
    capture_output=True,
    text=True,
    env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    check=False,
  )
  result = h.parse_result(proc.stdout)
  if result is None:
    raise RuntimeError(f"{impl} {loop} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
  return result


def summarize(results: list[dict]) -> list[dict]:
  """Per loop and implementation: the median of each figure, and ours / tfrs."""
  rows = []
  for loop in dict.fromkeys(r["loop"] for r in results):
    medians = {
      impl: {
        f: statistics.median(r[f] for r in results if r["loop"] == loop and r["impl"] == impl)
        for f in FIGURES
      }
      for impl in IMPLS
    }
    ratio = {f: medians["ours"][f] / medians["tfrs"][f] for f in FIGURES}
    rounds = sum(r["loop"] == loop and r["impl"] == "ours" for r in results)
    rows.append({"loop": loop, "rounds": rounds, "medians": medians, "ratio": ratio})
  return rows


def markdown(rows: list[dict], layer: str, steps: int, load: str) -> str:
  lines = [
    f"TF Model Garden {CLIENT_VERSION} ranking trainer, DLRM, `{layer}` layer, batch {BATCH}; "
    f"medians of {rows[0]['rounds']} fresh processes per implementation, alternating; steady = "
    f"steps {MARK}-{steps}; ratio = ours / tfrs. Load while measuring: {load}.",
    "",
    "| loop | implementation | process start to step 1 (s) | to step 100 (s) "
    "| first 100 steps (s) | steady examples/s |",
    "|---|---|---:|---:|---:|---:|",
  ]
  for row in rows:
    for impl in IMPLS:
      m = row["medians"][impl]
      lines.append(
        f"| {row['loop']} | {impl} | {m['to_step_1_s']:.1f} | {m['to_step_100_s']:.1f} | "
        f"{m['first_100_steps_s']:.1f} | {m['steady_examples_per_s']:,.0f} |"
      )
    r = row["ratio"]
    lines.append(
      f"| {row['loop']} | ours / tfrs | {r['to_step_1_s']:.2f}x | {r['to_step_100_s']:.2f}x | "
      f"{r['first_100_steps_s']:.2f}x | {r['steady_examples_per_s']:.2f}x |"
    )
  return "\n".join(lines) + "\n"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks model_garden",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=300, help="steps per run (> 100)")
  parser.add_argument("--loops", default=",".join(LOOPS))
  parser.add_argument("--layer", choices=("partial", "tpu"), default="partial")
  parser.add_argument("--out", help="write model_garden.{json,md} into this folder")
  parser.add_argument("--child", help=argparse.SUPPRESS)
  parser.add_argument("--started-at", type=float, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  folder = client_dir()
  if not os.path.exists(os.path.join(folder, "src/official/recommendation/ranking/train.py")):
    sys.exit(setup_instructions(folder))
  if args.child:
    impl, loop = args.child.split(":")
    result = child(impl, loop, args.layer, args.steps, args.started_at)
    print("RESULT " + json.dumps(result), flush=True)
    return
  results = []
  for _ in range(args.rounds):
    for loop in args.loops.split(","):
      for impl in IMPLS:
        results.append(run_child(impl, loop, args))
        print(
          " ".join(
            f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in results[-1].items()
          ),
          flush=True,
        )
  rows = summarize(results)
  table = markdown(rows, args.layer, args.steps, first_steps.load_line(results))
  print(table)
  if args.out:
    record = {"runs": results, "summary": rows, "steps": args.steps}
    first_steps.save(args.out, "model_garden", record, table)


if __name__ == "__main__":
  main()
