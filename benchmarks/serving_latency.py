"""Latency, throughput, size and memory of exported serving models: tpu_embedding at each
table dtype next to tf-recommenders.

The same ranking model (tables `user` 100,000 x 32 and `movie` 20,000 x 32 with identical
values, dense 64-relu-1 with identical weights) is exported, each export in its own fresh
process: with `tpu_embedding.export_for_serving` at table_dtype float32 (None), float16,
bfloat16, int8 and int4, and with tf-recommenders 0.7.7's `TPUEmbedding` layer and
`tf.saved_model.save` (tfrs needs TF_USE_LEGACY_KERAS=1 before TensorFlow is imported). All
exports are then loaded in one fresh process that imports only TensorFlow, and their
`serving_default` signatures are timed in turn, call by call, on the same dense ids at batch 1,
64 and 1024: p50 and p99 latency per call, and throughput (examples per second at the mean
latency). The float32 exports must give the same predictions; the others' largest difference is
printed. Each export is also served alone in a fresh TF-only process, whose peak RSS is printed
beside that of a process that loads nothing; and the bytes of its tables (every variable with a
table's rows: codes, or int8/int4's fused rows of codes, scale and bias; tfrs's export also
holds its optimizer's slots).

`--large` runs the same model with tables that do not fit in the CPU's caches, as a large
recommender serves them: `user` 4,000,000 x 32 and `movie` 2,000,000 x 32 (float32 768 MB; tfrs's
export holds twice that with its Adagrad slots), with ids drawn both uniformly and Zipf-like
(exponent 1.2 over a fixed scattering of the rows: a few hot rows, a long tail). Every call gets
fresh ids (the same for each export in a turn), so that the rows a call reads are not left in the
caches by a request replayed before it. It takes about 4 minutes and 5 GB of memory (the process
timing all six exports). `--case wide` is the same bytes in rows four times as wide: 1,000,000 and
500,000 rows x 128.

One run; prints a markdown table and writes benchmarks/results/serving_latency.{md,json,png}
(serving_latency_large.* with --large, serving_latency_<case>.* with --case).

Usage: python benchmarks/serving_latency.py [--quick] [--large | --case wide] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# (implementation, table_dtype): the exports compared.
EXPORTS = (
  ("tpu_embedding", "float32"),
  ("tpu_embedding", "float16"),
  ("tpu_embedding", "bfloat16"),
  ("tpu_embedding", "int8"),
  ("tpu_embedding", "int4"),
  ("tfrs", "float32"),
)
NAMES = tuple(f"{implementation} {dtype}" for implementation, dtype in EXPORTS)
# The issue's targets: table bytes against float32's at dim 32.
SIZE_TARGETS = {"float16": 0.52, "int8": 0.33, "int4": 0.20}
BATCH_SIZES = (1, 64, 1024)
# The models measured: rows of the `user` and `movie` tables, their dim, and the id
# distributions a request's ids are drawn from.
CASES = {
  "small": {"rows": (100_000, 20_000), "dim": 32, "ids": ("uniform",)},
  "large": {"rows": (4_000_000, 2_000_000), "dim": 32, "ids": ("uniform", "zipf")},
  # The same bytes as "large" in rows four times as wide (FBGEMM-style rows of 136 bytes for int8
  # against float32's 512).
  "wide": {"rows": (1_000_000, 500_000), "dim": 128, "ids": ("uniform", "zipf")},
}
ZIPF_EXPONENT = 1.2


def draw_ids(rng, rows: int, batch: int, distribution: str):
  """`batch` ids in [0, rows): uniform, or Zipf-like (rank r drawn with probability ~ r**-1.2,
  ranks past `rows` folded back, then scattered over the table by a fixed bijection so that the
  hot rows are not neighbours)."""
  if distribution == "uniform":
    return rng.integers(0, rows, batch)
  ranks = (rng.zipf(ZIPF_EXPONENT, batch) - 1) % rows
  return ((ranks + 1) * 2_654_435_761) % rows  # a prime: a bijection of [0, rows) for rows < it


# ---------------------------------------------------------------------------------------------
# Export (one fresh process per implementation)


def export_model(implementation: str, dtype: str, directory: str, case: str) -> None:
  import tensorflow as tf
  import tf_keras

  E = tf.tpu.experimental.embedding

  def initializer(seed):
    def init(shape, dtype=tf.float32):
      return tf.random.stateless_uniform(
        shape, seed=[seed, 0], minval=-0.05, maxval=0.05, dtype=dtype
      )

    return init

  (users, movies), dim = CASES[case]["rows"], CASES[case]["dim"]
  config = {
    "user": E.FeatureConfig(E.TableConfig(users, dim, name="user", initializer=initializer(1))),
    "movie": E.FeatureConfig(E.TableConfig(movies, dim, name="movie", initializer=initializer(2))),
  }
  if implementation == "tfrs":
    import tensorflow_recommenders as tfrs

    embedding = tfrs.layers.embedding.TPUEmbedding(config, E.Adagrad(0.1))
  else:
    import tpu_embedding

    embedding = tpu_embedding.TPUEmbedding(config, E.Adagrad(0.1))

  class Ranker(tf_keras.Model):
    def __init__(self):
      super().__init__()
      self.embedding = embedding
      self.hidden = tf_keras.layers.Dense(
        64, activation="relu", kernel_initializer=tf_keras.initializers.GlorotUniform(seed=3)
      )
      self.out = tf_keras.layers.Dense(
        1, kernel_initializer=tf_keras.initializers.GlorotUniform(seed=4)
      )

    def call(self, features):
      activations = self.embedding(features)
      return self.out(self.hidden(tf.concat([activations["user"], activations["movie"]], 1)))

  model = Ranker()
  model({"user": tf.constant([0], tf.int64), "movie": tf.constant([0], tf.int64)})

  @tf.function(
    autograph=False,
    input_signature=[
      tf.TensorSpec([None], tf.int64, name="user_id"),
      tf.TensorSpec([None], tf.int64, name="movie_id"),
    ],
  )
  def serve(user_id, movie_id):
    return {"score": model({"user": user_id, "movie": movie_id})}

  if implementation == "tfrs":
    tf.saved_model.save(model, directory, signatures={"serving_default": serve})
  else:
    from tpu_embedding.serving import export_for_serving

    export_for_serving(model, directory, serve, table_dtype=None if dtype == "float32" else dtype)


# ---------------------------------------------------------------------------------------------
# Measurement (one fresh process per export, TensorFlow only)


def _measure(directories: list[str], out: str, quick: bool, case: str = "small") -> None:
  """Times every export in this one process, call by call in turn (so that a change of load on
  the machine reaches each alike), each on the same requests."""
  import numpy as np
  import tensorflow as tf

  serves = [tf.saved_model.load(d).signatures["serving_default"] for d in directories]
  rng = np.random.default_rng(0)
  results = [{"rows": []} for _ in directories]
  for distribution in CASES[case]["ids"]:
    for batch in BATCH_SIZES:
      times = _time_calls(serves, rng, case, distribution, batch, quick)
      for result, taken in zip(results, times):
        taken = np.array(taken)
        result["rows"].append(
          {
            "ids": distribution,
            "batch": batch,
            "calls": len(taken),
            "p50_ms": float(np.percentile(taken, 50) * 1e3),
            "p99_ms": float(np.percentile(taken, 99) * 1e3),
            "examples_per_s": float(batch / taken.mean()),
          }
        )
  tensorflow_only = not [
    m for m in sys.modules if m.startswith(("tpu_embedding", "tensorflow_recommenders"))
  ]
  users, movies = CASES[case]["rows"]
  for result, serve, directory in zip(results, serves, directories):
    probe = serve(
      user_id=tf.constant([0, 5, users - 1], tf.int64),
      movie_id=tf.constant([0, 7, movies - 1], tf.int64),
    )["score"].numpy()
    result["probe"] = probe.ravel().tolist()
    result["tensorflow_only"] = tensorflow_only
    result["export_mb"] = (
      sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(directory) for f in fs) / 1e6
    )
    result["table_mb"] = table_bytes(directory, (users, movies)) / 1e6
  with open(out, "w") as f:
    json.dump(results, f)


def make_request(rng, case: str, distribution: str, batch: int) -> dict:
  import tensorflow as tf

  users, movies = CASES[case]["rows"]
  return {
    "user_id": tf.constant(draw_ids(rng, users, batch, distribution), tf.int64),
    "movie_id": tf.constant(draw_ids(rng, movies, batch, distribution), tf.int64),
  }


def _time_calls(serves, rng, case: str, distribution: str, batch: int, quick: bool) -> list:
  """Seconds per call of each serve, called in turn, each turn on fresh ids (drawn before the
  clock starts) that every serve gets."""
  for serve in serves:
    for _ in range(20):  # warm up
      serve(**make_request(rng, case, distribution, batch))["score"].numpy()
  budget = len(serves) * (0.5 if quick else 3.0)
  times = [[] for _ in serves]
  start = time.perf_counter()
  while (time.perf_counter() - start < budget or len(times[0]) < 50) and len(times[0]) < 20_000:
    call = len(times[0])
    request = make_request(rng, case, distribution, batch)
    for turn in range(len(serves)):
      which = (call + turn) % len(serves)  # who goes first changes every call
      t0 = time.perf_counter()
      serves[which](**request)["score"].numpy()
      times[which].append(time.perf_counter() - t0)
  return times


def table_bytes(directory: str, rows: tuple[int, ...]) -> int:
  """Bytes of the export's variables holding a table's rows: those with `rows` rows."""
  import numpy as np
  import tensorflow as tf

  reader = tf.train.load_checkpoint(os.path.join(directory, "variables", "variables"))
  shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
  return sum(
    int(np.prod(shape)) * dtypes[name].size
    for name, shape in shapes.items()
    if shape and shape[0] in rows
  )


def _peak_rss(directory: str, out: str, case: str = "small") -> None:
  """Peak RSS (MB) of this process after loading `directory` (if any) and serving each batch
  size a few times."""
  import resource

  import numpy as np
  import tensorflow as tf

  if directory:
    serve = tf.saved_model.load(directory).signatures["serving_default"]
    rng = np.random.default_rng(0)
    for batch in BATCH_SIZES:
      for _ in range(20):
        serve(**make_request(rng, case, "uniform", batch))["score"].numpy()
  with open(out, "w") as f:
    json.dump(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, f)


# ---------------------------------------------------------------------------------------------
# Orchestration


def _run(args: list[str], tfrs: bool = False) -> None:
  env = dict(
    os.environ,
    TF_CPP_MIN_LOG_LEVEL="3",
    PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
  )
  env.pop("TF_USE_LEGACY_KERAS", None)
  if tfrs:
    env["TF_USE_LEGACY_KERAS"] = "1"
  subprocess.run([sys.executable, os.path.abspath(__file__), *args], env=env, check=True)


def _table(results: dict, baseline_rss: float) -> str:
  float32 = results["tpu_embedding float32"]
  reference = {(r["ids"], r["batch"]): r for r in float32["rows"]}
  lines = [
    "| export | ids | batch | p50 ms | p99 ms | p50 x float32 | p99 x float32 | examples/s | "
    "tables MB | x float32 | export MB | peak RSS MB |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for name in NAMES:
    result = results[name]
    for row in result["rows"]:
      base = reference[(row["ids"], row["batch"])]
      lines.append(
        f"| {name} | {row['ids']} | {row['batch']} | {row['p50_ms']:.3f} | {row['p99_ms']:.3f} | "
        f"{row['p50_ms'] / base['p50_ms']:.2f} | {row['p99_ms'] / base['p99_ms']:.2f} | "
        f"{row['examples_per_s']:,.0f} | {result['table_mb']:.2f} | "
        f"{result['table_mb'] / float32['table_mb']:.3f} | {result['export_mb']:.1f} | "
        f"{result['peak_rss_mb']:.0f} |"
      )
  lines.append(f"\nPeak RSS of a TF-only process that loads nothing: {baseline_rss:.0f} MB.")
  return "\n".join(lines)


def _verdicts(results: dict) -> str:
  """The issue's targets, each met or not, from this run's figures."""
  float32 = results["tpu_embedding float32"]
  lines = []
  for dtype, target in SIZE_TARGETS.items():
    ratio = results[f"tpu_embedding {dtype}"]["table_mb"] / float32["table_mb"]
    verdict = "met" if ratio <= target else "NOT met"
    lines.append(f"- {dtype} tables {ratio:.3f}x float32's (target <= {target}x): {verdict}")
  for distribution in dict.fromkeys(r["ids"] for r in float32["rows"]):
    p50 = {
      n: next(
        r["p50_ms"] for r in results[n]["rows"] if (r["ids"], r["batch"]) == (distribution, 1024)
      )
      for n in ("tpu_embedding int8", "tpu_embedding float32")
    }
    ratio = p50["tpu_embedding int8"] / p50["tpu_embedding float32"]
    verdict = "met" if ratio <= 1.0 else "NOT met"
    lines.append(
      f"- int8 p50 at batch 1024, {distribution} ids, {ratio:.2f}x float32's "
      f"({p50['tpu_embedding int8']:.3f} vs {p50['tpu_embedding float32']:.3f} ms; "
      f"target: no slower): {verdict}"
    )
  return "\n".join(lines)


def _plot(results: dict, path: str, title: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  distributions = list(dict.fromkeys(r["ids"] for r in results[NAMES[0]]["rows"]))
  fig, axes = plt.subplots(
    len(distributions), 2, figsize=(11, 4 * len(distributions)), squeeze=False
  )
  for (latency, throughput), distribution in zip(axes, distributions):
    for name, marker in zip(NAMES, "os^vDx"):
      rows = [r for r in results[name]["rows"] if r["ids"] == distribution]
      batches = [r["batch"] for r in rows]
      latency.plot(batches, [r["p50_ms"] for r in rows], marker=marker, label=f"{name} p50")
      latency.plot(
        batches, [r["p99_ms"] for r in rows], marker=marker, linestyle="--", label=f"{name} p99"
      )
      throughput.plot(batches, [r["examples_per_s"] for r in rows], marker=marker, label=name)
    for axis, what, unit in (
      (latency, "Latency per call", "ms"),
      (throughput, "Throughput", "examples / s"),
    ):
      axis.set_xscale("log")
      axis.set_yscale("log")
      axis.set_xlabel("batch size")
      axis.set_ylabel(unit)
      axis.set_title(f"{what} ({distribution} ids)")
      axis.grid(True, which="both", alpha=0.3)
      axis.legend(fontsize="small")
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="0.5 s per batch size instead of 3 s")
  parser.add_argument(
    "--large", action="store_true", help="tables of 4M and 2M rows, uniform and Zipf-like ids"
  )
  parser.add_argument(
    "--case", choices=tuple(CASES), default=None, help="'wide': 1M and 500k rows x 128"
  )
  parser.add_argument("--out", default=os.path.join(HERE, "results"))
  args = parser.parse_args()
  case_name = args.case or ("large" if args.large else "small")
  flags = ["--case", case_name]
  os.makedirs(args.out, exist_ok=True)
  load_at_start = os.getloadavg()[0]
  with tempfile.TemporaryDirectory() as work:
    exports = [os.path.join(work, name.replace(" ", "_")) for name in NAMES]
    for (implementation, dtype), export_dir in zip(EXPORTS, exports):
      _run(["_export", implementation, dtype, export_dir, *flags], tfrs=implementation == "tfrs")
    out = os.path.join(work, "measured.json")
    _run(["_measure", ",".join(exports), out, *flags] + (["--quick"] if args.quick else []))
    with open(out) as f:
      results = dict(zip(NAMES, json.load(f)))
    for name, export_dir in [("", ""), *zip(NAMES, exports)]:
      _run(["_peak_rss", export_dir, out, *flags])
      with open(out) as f:
        rss = json.load(f)
      if name:
        results[name]["peak_rss_mb"] = rss
      else:
        baseline_rss = rss
  import numpy as np

  reference = results["tpu_embedding float32"]["probe"]
  difference = {
    name: float(np.max(np.abs(np.subtract(results[name]["probe"], reference)))) for name in NAMES
  }
  table = _table(results, baseline_rss)
  note = (
    f"\nSame predictions from both float32 exports: max |difference| = "
    f"{difference['tfrs float32']:.2e}; the lowered exports' max |difference| from float32: "
    + ", ".join(f"{n.split()[1]} {difference[n]:.2e}" for n in NAMES[1:-1])
    + f"; loaded with TensorFlow only: {all(results[n]['tensorflow_only'] for n in NAMES)}."
    + "\nTargets:\n"
    + _verdicts(results)
    + f"\nMachine: {os.cpu_count()} CPU(s), load average {load_at_start:.1f} at the start, "
    f"{os.getloadavg()[0]:.1f} at the end "
    "(shared with other jobs: latencies are comparable within this run, where the exports are "
    "timed call by call in turn, not across runs)."
  )
  case = CASES[case_name]
  header = (
    f"Tables `user` {case['rows'][0]:,} and `movie` {case['rows'][1]:,} rows x {case['dim']}; "
    f"ids: {', '.join(case['ids'])}.\n\n"
  )
  print(header + table + note)
  stem = os.path.join(
    args.out, "serving_latency" + ("" if case_name == "small" else f"_{case_name}")
  )
  with open(stem + ".md", "w") as f:
    f.write(header + table + "\n" + note + "\n")
  with open(stem + ".json", "w") as f:
    json.dump(results, f, indent=1)
  _plot(
    results,
    stem + ".png",
    "Exported serving model on CPU (loaded with TensorFlow only); "
    + header.split(";")[0].replace("`", ""),
  )
  print(f"Wrote {stem}.png")


if __name__ == "__main__":
  case = sys.argv[sys.argv.index("--case") + 1] if "--case" in sys.argv[2:] else "small"
  if len(sys.argv) > 1 and sys.argv[1] == "_export":
    export_model(sys.argv[2], sys.argv[3], sys.argv[4], case)
  elif len(sys.argv) > 1 and sys.argv[1] == "_peak_rss":
    _peak_rss(sys.argv[2], sys.argv[3], case)
  elif len(sys.argv) > 1 and sys.argv[1] == "_measure":
    _measure(sys.argv[2].split(","), sys.argv[3], quick="--quick" in sys.argv[4:], case=case)
  else:
    main()
