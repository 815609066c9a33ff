"""int8 serving lookup with every table stacked into one variable (issue 47).

The last idea left for int8 at batch 1024 with rows of 32 floats (1.04-1.10x float32's p50): a
request decodes each table's gathered rows with about eight nodes, where float32 runs one gather,
so stack the serving model's two int8 tables' fused rows into one variable and run one gather
(ids offset by the first table's rows) and one decode for both, then split the rows. Timed here
in one process as `tf.function`s over variables (no export: the stacked layout would change the
export's variables), call by call in turn against float32's two gathers and the shipped per-table
decode, on fresh uniform ids: p50 at batch 1, 64 and 1024 and the ratio to float32's.

Usage: python benchmarks/int8_stacked_tables.py [--calls N] [--rounds R]
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import tensorflow as tf

from tpu_embedding import quantization

ROWS = (100_000, 20_000)  # benchmarks/serving_latency.py's default case
DIM = 32
BATCHES = (1, 64, 1024)
INT8 = quantization.FORMATS["int8"]


def stacked_lookup(stacked: tf.Variable, first_rows: int, ids: list[tf.Tensor]) -> list[tf.Tensor]:
  """The decoded rows of `ids[0]` in the first table and `ids[1]` in the second, from one gather
  of their fused rows stacked in `stacked` and one decode."""
  rows = INT8.decode({"rows": tf.gather(stacked, tf.concat([ids[0], ids[1] + first_rows], 0))}, DIM)
  return tf.split(rows, [tf.shape(ids[0])[0], tf.shape(ids[1])[0]])


def lookups(tables: list[np.ndarray]) -> dict:
  """{name: a tf.function of (ids of the first table, ids of the second) -> their rows}."""
  floats = [tf.Variable(t) for t in tables]
  fused = [INT8.encode(tf.constant(t))["rows"] for t in tables]
  per_table = [tf.Variable(f) for f in fused]
  stacked = tf.Variable(tf.concat(fused, 0))
  spec = [tf.TensorSpec([None], tf.int64)] * 2

  def float32(i, j):
    return [tf.gather(floats[0], i), tf.gather(floats[1], j)]

  def int8_per_table(i, j):
    return [INT8.decode({"rows": tf.gather(v, k)}, DIM) for v, k in zip(per_table, (i, j))]

  def int8_stacked(i, j):
    return stacked_lookup(stacked, tables[0].shape[0], [i, j])

  return {
    f.__name__: tf.function(f, input_signature=spec, autograph=False)
    for f in (float32, int8_per_table, int8_stacked)
  }


def measure(calls: int, seed: int = 0) -> dict:
  """{batch: {name: p50 seconds}} over `calls` calls each, taken in turn."""
  rng = np.random.default_rng(seed)
  tables = [rng.normal(size=(rows, DIM)).astype(np.float32) for rows in ROWS]
  functions = lookups(tables)
  names = list(functions)
  result = {}
  for batch in BATCHES:
    times = {name: [] for name in names}
    for call in range(calls + 100):
      ids = [tf.constant(rng.integers(0, rows, batch)) for rows in ROWS]
      for turn in range(len(names)):
        name = names[(call + turn) % len(names)]  # who goes first changes every call
        start = tf.timestamp()
        functions[name](*ids)
        if call >= 100:  # the first 100 warm up
          times[name].append(float(tf.timestamp() - start))
    result[batch] = {name: float(np.median(t)) for name, t in times.items()}
  return result


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--calls", type=int, default=2000)
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  print("| round (load) | lookup | p50 µs at batch 1 / 64 / 1024 | x float32 |")
  print("|---|---|---|---|")
  for round_ in range(args.rounds):
    load = os.getloadavg()[0]
    result = measure(args.calls, seed=round_)
    for name in result[BATCHES[0]]:
      p50 = [result[b][name] for b in BATCHES]
      ratio = [result[b][name] / result[b]["float32"] for b in BATCHES]
      print(
        f"| {round_ + 1} ({load:.1f}) | {name} | {' / '.join(f'{p * 1e6:.0f}' for p in p50)} | "
        f"{' / '.join(f'{r:.3f}' for r in ratio)} |"
      )


if __name__ == "__main__":
  main()
