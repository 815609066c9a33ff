"""Which update formulation of the XLA path is faster, by table size and ids per step.

`tpu_embedding.engine.static_path` updates a table in one of two formulations (its module
docstring): the whole table (cost follows the table's rows) or unique rows (cost follows the
step's id slots). `static_path.update_for` picks the whole table for a lazy rule on one replica
while the table has at most `WHOLE_TABLE_ROWS_PER_ID` rows per id slot. This script measures
both on the same steps and prints, per optimizer, ids per step and table size, microseconds per
table update, the faster formulation and the one `update_for` picks, so the rule can be checked
against the machine.

Each measurement: `TABLES` tables of the same size and dim 16, one `tf.function(jit_compile=True)`
step updating all of them from Zipf(1.2) ids (what the other benchmarks draw), steps cycling
through 4 id batches; the formulations' steps alternate within each round, and the figures are
the median and minimum over rounds of the mean time per table update.

Usage: python -m benchmarks.static_path_formulations [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402  (after the environment variable above)
import tensorflow as tf  # noqa: E402

from benchmarks import harness as h  # noqa: E402
from tpu_embedding import config  # noqa: E402
from tpu_embedding.engine import (
  static_path,  # noqa: E402
  updates,  # noqa: E402
)
from tpu_embedding.engine.state import TableState  # noqa: E402

E = tf.tpu.experimental.embedding
DIM = 16
TABLES = 8  # tables per step, so one call's fixed cost is shared
NUM_BATCHES = 4
OPTIMIZERS = {"adagrad": lambda: E.Adagrad(0.01), "lazy adam": lambda: E.Adam(0.001)}
FULL = {
  "optimizers": ("adagrad", "lazy adam"),
  "ids": (1024, 4096),
  "rows": (256, 1024, 2048, 4096, 8192, 12288, 16384, 32768, 131072),
  "rounds": 7,
  "steps": 10,
}
QUICK = dict(FULL, optimizers=("adagrad",), ids=(4096,), rounds=5)


def _zipf_ids(rng: np.random.Generator, rows: int, n: int) -> tf.Tensor:
  return tf.constant(((rng.zipf(1.2, n) - 1) % rows).astype(np.int64))


def _step(form: updates.XlaForm, rule: updates.UpdateRule, rows: int, grads: tf.Tensor):
  """(step(ids), its tables): one jit step updating `TABLES` fresh tables in formulation `form`."""
  optimizer = rule.optimizer
  slots = config.slot_shapes(E.TableConfig(rows, DIM, optimizer=optimizer))
  states = [
    TableState(
      tf.Variable(tf.random.uniform([rows, DIM], -0.05, 0.05)),
      tuple(tf.Variable(tf.fill(shape, 0.1)) for _, shape in slots),
    )
    for _ in range(TABLES)
  ]
  update = static_path.FORMULATIONS[form]
  learning_rate = tf.constant(optimizer.learning_rate, tf.float32)

  @tf.function(jit_compile=True)
  def step(ids):
    for state in states:
      update(rule, state, ids, grads, rows, learning_rate)

  return step, states


def measure(optimizer: str, ids: int, rows: int, rounds: int, steps: int) -> dict:
  """Microseconds per table update of each formulation: {name: [per round]}."""
  rng = np.random.default_rng(0)
  rule = updates.rule_for(OPTIMIZERS[optimizer]())
  batches = [_zipf_ids(rng, rows, ids) for _ in range(NUM_BATCHES)]
  grads = tf.constant(rng.standard_normal((ids, DIM)).astype(np.float32))
  built = {form.value: _step(form, rule, rows, grads) for form in static_path.FORMULATIONS}
  for step, _ in built.values():
    step(batches[0])  # compiles
  times = {name: [] for name in built}
  for _ in range(rounds):
    for name, (step, states) in built.items():
      start = time.perf_counter()
      for k in range(steps):
        step(batches[k % NUM_BATCHES])
      states[0].parameters.numpy()  # waits for the last step
      times[name].append((time.perf_counter() - start) / steps / TABLES * 1e6)
  chosen = static_path.update_for(rule, False, rows, ids).value
  return {"optimizer": optimizer, "ids": ids, "rows": rows, "us": times, "chosen": chosen}


def report(results: Sequence[dict], command: str) -> str:
  names = [form.value for form in static_path.FORMULATIONS]
  rows = []
  for r in results:
    stats = {name: h.summarize(r["us"][name]) for name in names}
    faster = min(names, key=lambda name: stats[name].median)
    rows.append(
      [r["optimizer"], f"{r['ids']:,}", f"{r['rows']:,}", f"{r['rows'] / r['ids']:.2g}"]
      + [f"{stats[n].median:.0f} (min {stats[n].lo:.0f})" for n in names]
      + [faster, r["chosen"], "yes" if faster == r["chosen"] else "NO"]
    )
  header = ["optimizer", "ids/step", "rows", "rows/id"]
  header += [f"{n}: us/table" for n in names] + ["faster", "update_for picks", "agrees"]
  return "\n".join(
    [
      "# XLA path: whole-table vs unique-rows update, by table size",
      "",
      f"Command: `{command}`. {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPU(s), "
      f"1-min load average {os.getloadavg()[0]:.1f} at the end (a shared machine: noisy), "
      f"TF {tf.__version__}.",
      "",
      f"Each row: {TABLES} tables of dim {DIM} updated in one `jit_compile` step from Zipf(1.2) "
      "ids; microseconds per table update, median (min) over rounds that alternate the "
      "formulations. `update_for picks`: the formulation `static_path.update_for` takes for that "
      f"table on one replica (whole table up to {static_path.WHOLE_TABLE_ROWS_PER_ID} rows per "
      "id slot).",
      "",
      h.markdown_table(header, rows),
      "",
    ]
  )


def run(settings: dict, out_dir: Optional[str], command: str) -> str:
  results = []
  for optimizer in settings["optimizers"]:
    for ids in settings["ids"]:
      for rows in settings["rows"]:
        results.append(measure(optimizer, ids, rows, settings["rounds"], settings["steps"]))
        print(json.dumps(results[-1]), flush=True)
  text = report(results, command)
  print(text)
  if out_dir:
    with open(os.path.join(out_dir, "static_path_formulations.md"), "w", encoding="utf-8") as f:
      f.write(text)
    with open(os.path.join(out_dir, "static_path_formulations.json"), "w", encoding="utf-8") as f:
      json.dump(results, f, indent=1)
  return text


def main(argv: Optional[Sequence[str]] = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="Adagrad and 4096 ids per step only")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  args = parser.parse_args(argv)
  command = "python -m benchmarks.static_path_formulations" + (" --quick" if args.quick else "")
  run(QUICK if args.quick else FULL, args.out, command)


if __name__ == "__main__":
  main()
